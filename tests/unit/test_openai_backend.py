"""The OpenAI backends with the real ``openai`` client, against a local OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import copy
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
from openai_server import (
    CORPUS,
    LOCALHOST,
    FakeOpenAIServer,
    GroupClusterer,
    fake_completion,
    fake_embedding,
    openai_builder,
    tree_signature,
)

from raptor_core.backends.openai import (
    OpenAIChatLLM,
    OpenAIEmbedder,
    OpenAISummarizer,
    Usage,
)
from raptor_core.build.builder import describe
from raptor_core.components import recreate_embedder
from raptor_core.exceptions import (
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    MissingDependencyError,
)
from raptor_core.types import (
    DEFAULT_SUMMARY_PROMPT,
    LLM,
    AsyncEmbedder,
    AsyncLLM,
    AsyncSummarizer,
    Embedder,
    Summarizer,
)

pytestmark = [*LOCALHOST, pytest.mark.timeout(120)]

KEY = "sk-test-key-0123456789"


@pytest.fixture
def server():
    with FakeOpenAIServer(api_key=KEY) as srv:
        yield srv


@pytest.fixture(autouse=True)
def _no_openai_env(monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def test_protocols() -> None:
    llm = OpenAIChatLLM("m", api_key="k")
    assert isinstance(llm, LLM) and isinstance(llm, AsyncLLM)
    summarizer = OpenAISummarizer("m", api_key="k")
    assert isinstance(summarizer, Summarizer) and isinstance(summarizer, AsyncSummarizer)
    embedder = OpenAIEmbedder("e", api_key="k")
    assert isinstance(embedder, Embedder) and isinstance(embedder, AsyncEmbedder)


def test_summarizer_sends_the_paper_prompt(server) -> None:
    summarizer = OpenAISummarizer("fake-chat", base_url=server.url, api_key=KEY)
    texts = ["Cats purr softly.", "Kittens chase string."]
    summary = summarizer.summarize(texts, max_tokens=50)
    prompt = DEFAULT_SUMMARY_PROMPT.replace("{context}", "\n\n".join(texts))
    assert summary == fake_completion(prompt, 50)
    (record,) = server.requests("chat")
    assert record.body["messages"] == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": prompt},
    ]
    assert record.body["model"] == "fake-chat"
    assert record.body["max_tokens"] == 50
    assert record.body["temperature"] == 0.0
    assert record.authorization == f"Bearer {KEY}"
    usage = summarizer.usage.snapshot()
    assert usage["calls"] == usage["requests"] == 1
    assert usage["completion_tokens"] == len(summary.split())
    assert usage["prompt_tokens"] > 0


def test_user_prompt_template_and_request_options(server) -> None:
    template = 'Résumé en JSON {"points": [...]} de : {context}'
    summarizer = OpenAISummarizer(
        "fake-chat",
        base_url=server.url,
        api_key=KEY,
        prompt=template,
        system_prompt=None,
        temperature=None,
        max_tokens_param="max_completion_tokens",
    )
    summarizer.summarize(["un {texte} avec accolades"], max_tokens=7)
    (record,) = server.requests("chat")
    assert record.body["messages"] == [
        {
            "role": "user",
            "content": 'Résumé en JSON {"points": [...]} de : un {texte} avec accolades',
        }
    ]
    assert record.body["max_completion_tokens"] == 7
    assert "max_tokens" not in record.body and "temperature" not in record.body


def test_prompt_without_placeholder_is_rejected_before_any_request(server) -> None:
    summarizer = OpenAISummarizer("fake-chat", base_url=server.url, api_key=KEY, prompt="no slot")
    with pytest.raises(InvalidParameterError, match="context"):
        summarizer.summarize(["x"], max_tokens=5)
    assert server.requests() == []


async def test_async_complete_and_summarize(server) -> None:
    llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key=KEY)
    answers = await asyncio.gather(
        *(llm.acomplete(f"prompt number {i}", max_tokens=4) for i in range(5))
    )
    assert answers == [fake_completion(f"prompt number {i}", 4) for i in range(5)]
    summarizer = OpenAISummarizer("fake-chat", base_url=server.url, api_key=KEY)
    summary = await summarizer.asummarize(["alpha beta gamma"], max_tokens=9)
    assert summary == fake_completion(
        DEFAULT_SUMMARY_PROMPT.replace("{context}", "alpha beta gamma"), 9
    )
    assert llm.usage.snapshot()["calls"] == 5
    await llm.aclose()
    await summarizer.aclose()
    assert await llm.acomplete("after close") == fake_completion("after close")  # reopened
    await llm.aclose()


def test_async_client_survives_a_new_event_loop(server) -> None:
    llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key=KEY)
    assert asyncio.run(llm.acomplete("first loop")) == fake_completion("first loop")
    assert asyncio.run(llm.acomplete("second loop")) == fake_completion("second loop")


def test_embedder_batches_and_keeps_order(server) -> None:
    embedder = OpenAIEmbedder(
        "fake-embed", base_url=server.url, api_key=KEY, batch_size=2, max_concurrency=1
    )
    texts = [
        f"text number {i} about {w}"
        for i, w in enumerate(["cats", "dogs", "rockets", "bread", "rain"])
    ]
    vectors = embedder.embed_documents(texts)
    assert vectors.shape == (5, server.dim) and vectors.dtype == np.float32
    expected = np.stack([fake_embedding(t, server.dim) for t in texts])
    np.testing.assert_allclose(vectors, expected, rtol=1e-6)
    records = server.requests("embeddings")
    assert [r.inputs for r in records] == [texts[0:2], texts[2:4], texts[4:5]]
    assert all(r.body["encoding_format"] == "float" for r in records)
    assert embedder.usage.snapshot()["calls"] == 3
    query = embedder.embed_query("cats")
    assert query.shape == (server.dim,)


async def test_embedder_concurrency_is_bounded() -> None:
    with FakeOpenAIServer(embed_delay=0.2) as srv:
        embedder = OpenAIEmbedder(
            "e", base_url=srv.url, api_key=KEY, batch_size=2, max_concurrency=3
        )
        texts = [f"t{i}" for i in range(16)]  # 8 batches
        await embedder.aembed_documents(["warm up the client"])
        srv.reset()
        start = time.perf_counter()
        vectors = await embedder.aembed_documents(texts)
        elapsed = time.perf_counter() - start
        assert vectors.shape == (16, srv.dim)
        assert srv.max_in_flight == 3
        assert elapsed < 6 * 0.2  # 3 at a time: about 3 delays; one at a time would be 8
        srv.reset()
        embedder.embed_documents(texts)
        assert srv.max_in_flight <= 3


def test_embedder_dimensions_and_bad_input(server) -> None:
    embedder = OpenAIEmbedder("fake-embed", base_url=server.url, api_key=KEY, dimensions=16)
    embedder.embed_documents(["hello"])
    assert server.requests("embeddings")[0].body["dimensions"] == 16
    with pytest.raises(InvalidInputError, match="empty"):
        embedder.embed_documents(["ok", "   "])
    assert len(server.requests()) == 1
    assert embedder.embed_documents([]).shape[0] == 0
    with pytest.raises(InvalidParameterError, match="batch_size"):
        OpenAIEmbedder("e", api_key="k", batch_size=0).embed_documents(["x"])


def test_recorded_params_describe_the_embedder_but_never_recreate_it(server) -> None:
    embedder = OpenAIEmbedder("fake-embed", base_url=server.url, api_key=KEY, batch_size=7)
    description = describe(embedder)
    assert KEY not in repr(description) and KEY not in repr(embedder)
    assert description["model"] == "fake-embed" and description["batch_size"] == 7
    # A remote model is never created from a file: the caller passes it (issue 11).
    with pytest.raises(InvalidParameterError, match=r"embedder=OpenAIEmbedder\('fake-embed'"):
        recreate_embedder(description)
    assert server.requests() == []


def test_copies_and_pickles_without_clients(server) -> None:
    llm = OpenAIChatLLM("fake-chat", base_url=server.url, api_key=KEY)
    llm.complete("warm the client")
    for clone in (copy.deepcopy(llm), pickle.loads(pickle.dumps(llm))):
        assert clone.complete("again") == fake_completion("again")
        assert clone.usage.snapshot()["calls"] >= 1
    assert pickle.loads(pickle.dumps(Usage())).snapshot()["calls"] == 0


def test_key_from_environment_and_self_hosted_default(monkeypatch) -> None:
    with FakeOpenAIServer() as open_server:  # a self-hosted server without authentication
        llm = OpenAIChatLLM("m", base_url=open_server.url)
        assert llm.complete("hi there") == fake_completion("hi there")
        assert open_server.requests()[0].authorization == "Bearer not-needed"
    with FakeOpenAIServer(api_key=KEY) as locked:
        monkeypatch.setenv("OPENAI_API_KEY", KEY)
        monkeypatch.setenv("OPENAI_BASE_URL", locked.url)
        assert OpenAIChatLLM("m").complete("from env") == fake_completion("from env")


def test_missing_key_fails_before_any_request(monkeypatch) -> None:
    llm = OpenAIChatLLM("gpt-4o-mini")
    with pytest.raises(LLMAuthenticationError, match="OPENAI_API_KEY"):
        llm.check_settings()
    with pytest.raises(LLMAuthenticationError, match="OPENAI_API_KEY"):
        llm.complete("hello")


def test_missing_openai_package_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "openai", None)
    llm = OpenAIChatLLM("m", api_key="k")
    with pytest.raises(MissingDependencyError, match=r"raptor-retriever\[openai\]"):
        llm.complete("hi")


def test_importing_the_backend_does_not_import_openai() -> None:
    code = "import sys, raptor_core.backends.openai; assert 'openai' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- building through the server -----------------------------------------------------------------
def _expected_prompts(tree) -> list[str]:
    prompts = []
    for node in tree.nodes:
        if node.layer > 0:
            context = "\n\n".join(tree.node(c).text for c in node.children)
            prompts.append(DEFAULT_SUMMARY_PROMPT.replace("{context}", context))
    return prompts


def test_builds_a_tree_through_the_server_with_the_expected_prompts(server) -> None:
    tree = openai_builder(server.url, api_key=KEY).build(CORPUS)
    summaries = [n for n in tree.nodes if n.layer > 0]
    assert tree.num_layers >= 3 and summaries
    received = [r.prompt for r in server.requests("chat")]
    assert sorted(received) == sorted(_expected_prompts(tree))
    for node in summaries:
        context = "\n\n".join(tree.node(c).text for c in node.children)
        assert node.text == fake_completion(
            DEFAULT_SUMMARY_PROMPT.replace("{context}", context), 20
        )
    leaves = np.stack([fake_embedding(n.text, server.dim) for n in tree.leaves])
    np.testing.assert_allclose(tree.embeddings[: len(tree.leaves)], leaves, rtol=1e-5, atol=1e-6)
    # cost per layer, from the response usage fields
    info = tree.build_info
    for layer in info["layers"][1:]:
        assert layer["usage"]["summarize"]["calls"] == layer["nodes"]
        assert layer["usage"]["summarize"]["prompt_tokens"] > 0
        assert layer["usage"]["embed"]["calls"] >= 1
    assert info["usage"]["summarize"]["calls"] == len(summaries)
    assert KEY not in str(tree.params)


async def test_abuild_matches_build(server) -> None:
    sync_tree = openai_builder(server.url, api_key=KEY).build(CORPUS)
    async_tree = await openai_builder(server.url, api_key=KEY).abuild(CORPUS)
    assert tree_signature(async_tree) == tree_signature(sync_tree)
    np.testing.assert_array_equal(async_tree.embeddings, sync_tree.embeddings)


@pytest.mark.parametrize("mode", ["build", "abuild"])
def test_a_layer_takes_about_n_over_limit_delays(mode: str) -> None:
    delay, n_clusters, limit = 0.2, 12, 4
    docs = [f"Topic {i} words here and more words." for i in range(n_clusters * 2)]
    with FakeOpenAIServer(delay=delay) as srv:
        builder = openai_builder(
            srv.url,
            max_concurrency=limit,
            clusterer=GroupClusterer(2),
            max_layers=1,
            chunk_max_tokens=50,
        )
        tree = builder.build(docs) if mode == "build" else asyncio.run(builder.abuild(docs))
        assert len(tree.layer(1)) == n_clusters
        spent = tree.build_info["timings"]["summarize"]
        assert srv.max_in_flight == limit  # the limit is reached, never passed
        # (N / limit) * delay = 0.6 s; sequential would be 2.4 s.
        assert (n_clusters / limit) * delay * 0.9 <= spent < (n_clusters / limit + 5) * delay


def test_a_layer_with_concurrency_one_is_sequential() -> None:
    with FakeOpenAIServer(delay=0.05) as srv:
        builder = openai_builder(
            srv.url, max_concurrency=1, clusterer=GroupClusterer(2), max_layers=1
        )
        builder.build(CORPUS[:4])
        assert srv.max_in_flight == 1


def test_default_clusterer_builds_through_the_server(server) -> None:
    """The real UMAP + GMM clustering over embeddings served by the local server."""
    from raptor_core.build.clustering import GMMClusterer

    corpus = CORPUS * 2
    docs = [{"doc_id": f"d{i}", "text": text} for i, text in enumerate(corpus)]
    builder = openai_builder(server.url, api_key=KEY, clusterer=GMMClusterer(random_state=0))
    tree = builder.build(docs)
    assert tree.num_layers >= 2
    assert sorted(r.prompt for r in server.requests("chat")) == sorted(_expected_prompts(tree))
    assert len(server.successes("chat")) == len(tree) - len(tree.leaves)


def test_cli_builds_resumes_and_queries_through_the_server(
    server, tmp_path, monkeypatch, capsys
) -> None:
    from raptor_core.cli import main

    for i, text in enumerate(CORPUS):
        (tmp_path / f"doc{i}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "tree"
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    args = [
        "build", str(tmp_path), "--out", str(out),
        "--llm", "openai", "--llm-model", "fake-chat", "--llm-base-url", server.url,
        "--embed-provider", "openai", "--openai-embed-model", "fake-embed",
        "--chunk-tokens", "24", "--summary-tokens", "30",
        "--max-concurrency", "3", "--timeout", "5",
    ]  # fmt: skip
    assert main([*args, "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "dry run" in dry and "total" in dry
    assert server.requests() == []  # a dry run spends nothing

    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "llm calls" in printed and "total" in printed
    first = len(server.requests())
    first_chat = len(server.requests("chat"))
    assert first > 0 and (out / "tree.json").is_file() and (out / ".raptor-cache").is_dir()
    assert server.max_in_flight <= 3

    assert main(args) == 2  # the tree is there: replacing it needs --overwrite
    assert "--overwrite" in capsys.readouterr().err
    assert len(server.requests()) == first  # refused before any work

    assert main([*args, "--overwrite"]) == 0  # resume is the default: all from the cache
    capsys.readouterr()
    assert len(server.requests()) == first

    assert main([*args, "--overwrite", "--no-resume"]) == 0  # pays again
    capsys.readouterr()
    assert len(server.requests("chat")) == 2 * first_chat

    question = "Which results were better than expected?"
    # The tree records an OpenAI embedder: a query never re-creates it from the file.
    assert main(["query", str(out), question, "--json"]) == 2
    err = capsys.readouterr().err
    assert "--embedder openai:fake-embed" in err and "Traceback" not in err
    before = len(server.requests())
    embed = ["--embedder", "openai:fake-embed", "--embed-base-url", server.url]
    assert main(["query", str(out), question, "--json", *embed]) == 0
    assert '"layer"' in capsys.readouterr().out
    assert len(server.requests("embeddings")) > 0 and len(server.requests()) == before + 1
