"""Build a RAPTOR tree with a hosted or self-hosted LLM: OpenAI, vLLM, Ollama, llama.cpp.

Why: the offline quickstart summarises extractively.  Real abstractive summaries come from a
chat model, and a build makes one call per cluster, thousands for a large corpus.  This
example shows the three things that make that practical:

* concurrency: the summaries of a layer are requested ``max_concurrency`` at a time;
* the build cache: every answer is committed as it arrives, so rerunning the script after
  Ctrl-C (or a crash, or a rate-limit storm) makes only the calls it had not made, and a
  second run of a finished build costs nothing;
* cost reporting: calls and tokens per layer, and a dry-run estimate before spending.

Configure it with environment variables, for example::

    # OpenAI
    export OPENAI_API_KEY=sk-...
    # Ollama (ollama pull llama3.1 && ollama pull nomic-embed-text)
    export OPENAI_BASE_URL=http://localhost:11434/v1
    export RAPTOR_CHAT_MODEL=llama3.1 RAPTOR_EMBED_MODEL=nomic-embed-text

then run ``python examples/02_openai_compatible.py [files or folders ...]`` (default: docs/).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from raptor_core import CollapsedTreeRetriever, RaptorError, TreeBuilder
from raptor_core.backends.openai import OpenAIEmbedder, OpenAISummarizer
from raptor_core.cli import read_documents


def main() -> int:
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not os.environ.get("OPENAI_API_KEY") and not base_url:
        print(
            "Set OPENAI_API_KEY (OpenAI) or OPENAI_BASE_URL (a self-hosted server such as "
            "http://localhost:11434/v1 for Ollama) and run again.",
            file=sys.stderr,
        )
        return 2
    hosted = base_url is None
    chat_model = os.environ.get("RAPTOR_CHAT_MODEL", "gpt-4o-mini" if hosted else "llama3.1")
    embed_model = os.environ.get(
        "RAPTOR_EMBED_MODEL", "text-embedding-3-small" if hosted else "nomic-embed-text"
    )
    paths = sys.argv[1:] or [str(Path(__file__).resolve().parents[1] / "docs")]
    out = Path(os.environ.get("RAPTOR_OUT", ".raptor/openai-tree"))

    embedder = OpenAIEmbedder(embed_model, batch_size=64, max_concurrency=4)
    builder = TreeBuilder(
        embedder,
        OpenAISummarizer(chat_model, timeout=120),
        max_concurrency=8,
        random_state=0,  # the same clusters on a rerun, so the cache answers them
        cache=out / ".raptor-cache",
    )
    try:
        documents = read_documents(paths)
        estimate = builder.estimate(documents)
        print(
            f"{len(documents)} documents, {estimate.chunks} chunks: about {estimate.calls} "
            f"summary calls, {estimate.prompt_tokens + estimate.completion_tokens} LLM tokens"
        )
        tree = builder.build(documents)  # Ctrl-C is safe: rerun to resume
        tree.save(out)
    except RaptorError as exc:  # bad key, unknown model, server down: the message says what to fix
        print(f"error: {exc}", file=sys.stderr)
        return 1

    for layer in tree.build_info["layers"]:
        llm = layer.get("usage", {}).get("summarize", {})
        print(
            f"layer {layer['layer']}: {layer['nodes']} nodes, {llm.get('calls', 0)} LLM calls "
            f"({llm.get('cache_hits', 0)} from the cache), {llm.get('prompt_tokens', 0)} prompt + "
            f"{llm.get('completion_tokens', 0)} completion tokens"
        )
    retriever = CollapsedTreeRetriever(tree, embedder, k=3, max_tokens=800)
    for hit in retriever.retrieve("What is this collection of documents about?"):
        print(f"\n[{hit.node.id}, layer {hit.node.layer}, score {hit.score:.3f}]")
        print(hit.node.text[:300])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
