"""Run a script of benchmarks/ as a user would, in a process of its own.

The process is forked from the session's warm interpreter (tests/warm_python.py), which has
torch and the frameworks imported already.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Mapping
from pathlib import Path

from warm_python import warm_python

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(
    script: str, *args: str, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>``, offline, with this checkout importable.

    ``env`` adds to this process's environment (``RAPTOR_EVAL_DATA`` for the scripts that
    read it).
    """
    environ = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    }
    path = ROOT / "benchmarks" / script
    return warm_python().run(
        [str(path), *args], script=path, cwd=os.getcwd(), env=environ, timeout=timeout
    )


# Words of a few topics: documents drawn from them cluster, and questions find their paragraph.
_TOPICS = {
    "ocean": "tide reef coral current salt wave kelp shore whale harbour",
    "forest": "oak moss fern canopy bark root squirrel trail pine clearing",
    "city": "tram bridge market tower street lantern square bakery clock alley",
    "kitchen": "oven flour butter kettle spoon bread pepper onion garlic stew",
}


def write_eval_data(folder: Path, *, docs: int = 3, paragraphs: int = 8) -> Path:
    """A tiny evaluation folder in the format of ../shared/data (see its README.md).

    ``qasper_docs.jsonl`` / ``qasper.jsonl`` (paragraphs one a line; each question's evidence
    is one paragraph of its document, its answer a phrase of that paragraph) and
    ``quality_docs.jsonl`` (documents only), so that the benchmarks reading the shared data
    run on it at a toy size, anywhere.
    """
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    topics = list(_TOPICS.values())
    papers, questions, articles = [], [], []
    for d in range(docs):
        lines = []
        for p in range(paragraphs):
            words = topics[(d + p) % len(topics)].split()
            sentences = [
                " ".join(rng.choice(words) for _ in range(rng.randint(8, 14))).capitalize() + "."
                for _ in range(4)
            ]
            lines.append(f"Paragraph {p} of paper {d}: " + " ".join(sentences))
        doc_id = f"paper-{d}"
        papers.append({"doc_id": doc_id, "title": f"Paper {d}", "text": "\n".join(lines)})
        articles.append({"doc_id": f"article-{d}", "title": "", "text": "\n\n".join(lines)})
        for p in (1, paragraphs - 2):
            questions.append(
                {
                    "doc_id": doc_id,
                    "question_id": f"{doc_id}-q{p}",
                    "question": f"What does paragraph {p} of paper {d} say?",
                    "answers": [" ".join(lines[p].split()[5:8])],
                    "evidence": [lines[p]],
                    "options": [],
                    "gold_option": None,
                }
            )
    for name, records in (
        ("qasper_docs", papers),
        ("qasper", questions),
        ("quality_docs", articles),
    ):
        text = "".join(json.dumps(r) + "\n" for r in records)
        (folder / f"{name}.jsonl").write_text(text, encoding="utf-8")
    return folder
