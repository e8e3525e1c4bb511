"""The ONNX export of the packaged all-MiniLM-L6-v2 gives sentence-transformers' vectors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")

from raptor_core.backends.onnx import OnnxEmbedder, export_info, export_onnx

HEAVY = ("umap", "numba", "pynndescent", "sklearn", "llama_index", "langchain", "langchain_core")

QUERY_IN_A_NEW_PROCESS = """
import json, sys
from raptor_core.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def run_query_process(args: list[str], env: dict[str, str]) -> tuple[list[dict], list[str]]:
    """Run ``raptor query ARGS --json`` in a fresh interpreter: (hits, heavy modules imported)."""
    code = QUERY_IN_A_NEW_PROCESS.format(heavy=set(HEAVY) | {"torch", "sentence_transformers"})
    out = subprocess.run(
        [sys.executable, "-c", code, "query", *args, "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    ).stdout
    hits_text, _, modules_line = out.rstrip().rpartition("\n")
    return json.loads(hits_text), json.loads(modules_line)


pytestmark = [pytest.mark.integration, pytest.mark.slow]

TEXTS = [
    "where do cats sleep?",
    "a",
    "",
    "Ünïcödé, 日本語のテキスト and emoji 🐈 in one query",
    # Longer than the model's 256-token window: truncated the same way.
    "The quick brown fox jumps over the lazy dog near the riverbank. " * 60,
]


EXPORT_WARNINGS: list[warnings.WarningMessage] = []


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory, st_embedder) -> Path:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = export_onnx(tmp_path_factory.mktemp("onnx") / "minilm")
    EXPORT_WARNINGS.extend(caught)
    return out


def test_export_is_one_file_made_without_deprecated_paths(export_dir: Path) -> None:
    # torch's export-based exporter, not the deprecated TorchScript one (which warns that it
    # will be removed), and the weights inside model.onnx: no external-data file beside it.
    assert sorted(p.name for p in export_dir.iterdir()) == [
        "model.onnx",
        "raptor-onnx.json",
        "tokenizer.json",
    ]
    noisy = [
        f"{w.category.__name__}: {w.message}"
        for w in EXPORT_WARNINGS
        if issubclass(w.category, DeprecationWarning | FutureWarning)
    ]
    assert noisy == []


def test_export_refuses_a_torch_without_dynamic_export(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from raptor_core.exceptions import MissingDependencyError

    monkeypatch.setattr(torch, "__version__", "2.5.1+cpu")
    with pytest.raises(MissingDependencyError, match=r"torch 2\.6 or later.*2\.5\.1"):
        export_onnx(tmp_path / "old")
    assert not (tmp_path / "old").exists()


def test_vectors_match_sentence_transformers(export_dir: Path, st_embedder) -> None:
    info = export_info(export_dir)
    assert info is not None and info["model_name_or_path"] == "all-MiniLM-L6-v2"
    onnx = OnnxEmbedder(export_dir, batch_size=2)  # batches of 2: padding is exercised
    assert onnx.dim == 384
    ours = onnx.embed_documents(TEXTS)
    reference = st_embedder.embed_documents(TEXTS)
    cosines = np.sum(ours * reference, axis=1)
    assert cosines.min() >= 0.999, cosines
    for text in TEXTS[:2]:
        assert float(onnx.embed_query(text) @ st_embedder.embed_query(text)) >= 0.999


def test_raptor_query_uses_the_export_without_torch(
    export_dir: Path, real_tree, tmp_path: Path
) -> None:
    tree_dir = tmp_path / "tree"
    real_tree.save(tree_dir)
    repo = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": repo + (os.pathsep + path if path else ""),
        "HF_HUB_OFFLINE": "1",
    }
    question = [str(tree_dir), "which animals purr?", "-k", "4"]
    with_onnx, imported = run_query_process(question, {**env, "RAPTOR_ONNX_DIR": str(export_dir)})
    assert imported == []  # neither torch nor sentence-transformers, nor anything in HEAVY
    without, imported_st = run_query_process([*question, "--no-onnx"], env)
    assert "torch" in imported_st and not set(imported_st) & set(HEAVY) - {"sklearn"}
    assert [h["id"] for h in with_onnx] == [h["id"] for h in without]
    for a, b in zip(with_onnx, without, strict=True):
        assert abs(a["score"] - b["score"]) < 1e-4
