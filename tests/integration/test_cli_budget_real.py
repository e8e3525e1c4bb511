"""``raptor build`` and ``raptor add`` under a budget, through the local OpenAI-compatible server.

Real processes, the real ``openai`` client and the default clusterer (UMAP): the capped build
stops with exit status 1 and the rerun with a higher cap pays for nothing twice.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from openai_server import LOCALHOST, FakeOpenAIServer
from warm_python import raptor

pytestmark = [pytest.mark.integration, *LOCALHOST, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "corpus"


# -- through the local OpenAI-compatible server ------------------------------------------------
def _openai_flags(url: str) -> list[str]:
    return [
        "--llm", "openai", "--llm-model", "fake-chat", "--llm-base-url", url,
        "--embed-provider", "openai", "--openai-embed-model", "fake-embed",
        "--chunk-tokens", "40", "--no-progress",
    ]  # fmt: skip


def test_build_stops_at_the_cap_and_resumes_with_a_higher_one(tmp_path: Path) -> None:
    out = tmp_path / "tree"
    env = {"OPENAI_API_KEY": "sk-test-budget"}
    with FakeOpenAIServer() as server:
        flags = [str(CORPUS), "--out", str(out), *_openai_flags(server.url)]
        stopped = raptor("build", *flags, "--max-summary-tokens", "1200", env=env)
        assert stopped.returncode == 1, stopped.stderr
        assert "LLM budget reached" in stopped.stderr
        assert "max_summary_tokens=1200" in stopped.stderr
        assert not (out / "tree.json").exists()
        first = [r.prompt for r in server.requests("chat")]
        assert first
        server.reset()
        prices = ["--price-prompt", "1000", "--price-completion", "2000"]
        done = raptor("build", *flags, "--max-summary-tokens", "100000", *prices, env=env)
        assert done.returncode == 0, done.stderr
        second = [r.prompt for r in server.requests("chat")]
    assert not set(first) & set(second)  # nothing paid twice
    assert "llm cost: $" in done.stdout
    assert "(cap: 100000 tokens)" in done.stdout


def test_add_stops_at_the_cap_and_leaves_the_tree(tmp_path: Path) -> None:
    out = tmp_path / "tree"
    env = {"OPENAI_API_KEY": "sk-test-budget"}
    docs = sorted(CORPUS.iterdir())
    with FakeOpenAIServer() as server:
        flags = _openai_flags(server.url)
        built = raptor("build", *map(str, docs[:-1]), "--out", str(out), *flags, env=env)
        assert built.returncode == 0, built.stderr
        before = (out / "tree.json").read_bytes()
        added = raptor(
            "add", str(out), str(docs[-1]), "--llm", "openai", "--llm-base-url", server.url,
            "--embedder", "openai:fake-embed",
            "--no-progress", "--max-summary-tokens", "1", env=env,
        )  # fmt: skip
    assert added.returncode == 1, added.stderr
    assert "LLM budget reached" in added.stderr
    assert (out / "tree.json").read_bytes() == before
