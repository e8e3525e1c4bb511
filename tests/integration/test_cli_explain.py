"""``raptor query --explain`` through the installed command: traversal, value and LLM search.

The tree is built with the fakes (re-created from the tree's record, so no model loads) and
the LLM-guided search talks to the local fake OpenAI server through the real ``openai``
client.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import warm_python
from openai_server import FakeOpenAIServer

from raptor_core.testing import tiny_tree

pytestmark = pytest.mark.integration


def raptor(*args: str) -> subprocess.CompletedProcess[str]:
    return warm_python.raptor(*args, env={"OPENAI_API_KEY": "sk-test-explain"}, timeout=120)


def pick_rockets(prompt: str, max_tokens: int | None) -> str:
    """Choose the candidates whose text is about rockets or orbits."""
    chosen = re.findall(r"\[(L\d\.\d)\][^\[]*?(?:Rocket|rocket|orbit)", prompt)
    return json.dumps({"selected": [{"id": i, "reason": "about rockets"} for i in chosen[:1]]})


@pytest.fixture(scope="module")
def tree_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("explain") / "tree"
    tiny_tree(dim=16).save(directory)
    return str(directory)


def test_explain_traversal_and_value(tree_dir: str) -> None:
    proc = raptor(
        "query", tree_dir, "rockets orbit", "--strategy", "traversal", "--top-k-per-layer", "1",
        "--explain",
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:2] == [
        "search path (traversal), top layer first; score = cosine with the question:",
        "  layer 1:",
    ]
    assert re.fullmatch(
        r"    L1\.1  0\.\d{3}  hit #1 \(rank 1 among the nodes of layer 1\)", lines[2]
    )
    assert lines[3] == "  layer 0:"
    assert re.fullmatch(r"    L0\.[23]  0\.\d{3}  hit #2 <- L1\.1 \(rank 1 .*\)", lines[4])

    proc = raptor(
        "query", tree_dir, "rockets orbit", "--strategy", "value", "--explain", "--json", "-k", "1"
    )
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    [hit] = document["hits"]
    roles = {n["id"]: n["roles"] for layer in document["explain"] for n in layer["nodes"]}
    assert roles[hit["id"]] == ["hit #1"]
    assert {e["id"] for e in hit["evidence"]} - {hit["id"]} == {
        i for i, r in roles.items() if r == ["evidence of #1"]
    }


def test_explain_llm_guided_search(tree_dir: str) -> None:
    with FakeOpenAIServer(completion=pick_rockets) as server:
        proc = raptor(
            "query", tree_dir, "How do rockets reach orbit?", "--strategy", "llm", "--llm", "openai",
            "--llm-model", "fake-chat", "--llm-base-url", server.url, "--explain", "-k", "3",
        )  # fmt: skip
        assert server.requests("chat")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("search path (llm), top layer first")
    layer1 = re.search(r"  layer 1:\n((?:    .*\n)+)", out)
    layer0 = re.search(r"  layer 0:\n((?:    .*\n)+)", out)
    assert layer1 and layer0, out
    assert re.search(r"L1\.1  0\.\d{3}  hit #\d \(about rockets\)", layer1.group(1)), out
    assert re.search(r"L0\.[23]  0\.\d{3}  hit #\d <- L1\.1 \(about rockets\)", layer0.group(1)), (
        out
    )
    assert "L1.0" not in layer1.group(1)  # the cats branch was not taken
