"""LLM-guided and hybrid search through the real `openai` client and a local server."""

from __future__ import annotations

import json
import re

import pytest
from openai_server import FakeOpenAIServer

from raptor_core import HybridRetriever, LLMGuidedRetriever, Tree
from raptor_core.backends.openai import OpenAIChatLLM
from raptor_core.cli import main

pytestmark = pytest.mark.integration

KEY = "sk-test-llm-search"


def scripted(prompt: str, max_tokens: int | None) -> str:
    """Pick the candidate whose text mentions the Moon; the judge says enough at once."""
    if '"enough"' in prompt:
        return json.dumps({"enough": True, "reason": "the landing is covered"})
    ids = re.findall(r"\[(L\d+[.-][0-9a-f]+)\]", prompt)
    chosen = [i for i in ids if i in MOON_IDS] or ids[:1]
    return (
        "```json\n"
        + json.dumps({"selected": [{"id": i, "reason": "mentions the Moon"} for i in chosen[:2]]})
        + "\n```"
    )


MOON_IDS: set[str] = set()


@pytest.fixture
def moon_tree(real_tree: Tree) -> Tree:
    MOON_IDS.clear()
    MOON_IDS.update(n.id for n in real_tree.nodes if "Moon" in n.text or "Apollo" in n.text)
    return real_tree


def test_llm_guided_search_through_openai_client(moon_tree: Tree, st_embedder, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeOpenAIServer(completion=scripted) as server:
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, timeout=5)
        retriever = LLMGuidedRetriever(moon_tree, st_embedder, llm=llm, k=4, max_tokens=600)
        hits = retriever.retrieve("When did Apollo 11 land on the Moon?")
        assert hits and all(h.source == "llm" for h in hits)
        assert any(h.reason == "mentions the Moon" for h in hits)
        assert any("Moon" in h.node.text or "Apollo" in h.node.text for h in hits)
        assert server.requests("chat")
        first_prompt = server.requests("chat")[0].prompt
        assert "When did Apollo 11 land on the Moon?" in first_prompt


async def test_hybrid_search_through_openai_client(
    moon_tree: Tree, st_embedder, monkeypatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with FakeOpenAIServer(completion=scripted) as server:
        llm = OpenAIChatLLM("fake-chat", base_url=server.url, timeout=5)
        retriever = HybridRetriever(
            moon_tree, st_embedder, llm=llm, k=6, max_tokens=800, timeout=30
        )
        result = await retriever.asearch("Who walked on the Moon in 1969?")
        assert result.hits
        assert result.stopped_early and result.stop_reason == "judge"
        # The judge said "enough" after the first node: one node, found by one of the searches.
        assert len(result.hits) == 1
        finders = {f for found in result.found_by.values() for f in found}
        assert finders <= {"value", "llm"} and finders
        assert result.hits[0].source in result.found_by[result.hits[0].id]
        judge_prompts = [r.prompt for r in server.requests("chat") if '"enough"' in r.prompt]
        assert judge_prompts


def test_cli_query_llm_strategy_through_server(
    moon_tree: Tree, tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    moon_tree.save(tmp_path / "tree")
    with FakeOpenAIServer(completion=scripted) as server:
        code = main(
            ["query", str(tmp_path / "tree"), "When did Apollo 11 land?", "--strategy", "llm", "--llm", "openai",
             "--llm-model", "fake-chat", "--llm-base-url", server.url, "--json", "-k", "3"]
        )  # fmt: skip
        assert code == 0
        hits = json.loads(capsys.readouterr().out)
        assert hits and all(h["source"] == "llm" for h in hits)
        assert any(h.get("reason") == "mentions the Moon" for h in hits)
        assert server.requests("chat")
