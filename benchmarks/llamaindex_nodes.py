"""RAPTOR over LlamaIndex's default nodes, as retrievers for ``quality.py --retrievers``.

A LlamaIndex pipeline usually hands an index ``SentenceSplitter()``'s nodes (1,024 tokens,
200 of them repeated from the node before).  These two factories build a ``RaptorIndex``
over those nodes for each document and search it with the default strategy:

* ``NodesAsLeaves``: the nodes are the tree's leaves, as ``RaptorIndex(nodes)`` keeps them;
* ``NodesRejoined``: ``RaptorIndex(nodes, rejoin_nodes=True)``, the nodes joined back into
  their document and chunked by RAPTOR.

Run from the repository root (``quality.py`` puts ``benchmarks/`` on the path)::

    python benchmarks/quality.py --data ../shared/data --limit-docs 0 --limit-questions 0 \\
        --retrievers passage,nodes-as-leaves=llamaindex_nodes:NodesAsLeaves,nodes-rejoined=llamaindex_nodes:NodesRejoined

Both use the run's embedding model, tokenizer and seed, and the offline extractive
summariser, as the run's own trees do.
"""

from __future__ import annotations

from typing import Any

from llama_index.core import Document
from llama_index.core.node_parser import SentenceSplitter

from raptor_llamaindex import RaptorIndex

__all__ = ["NodesAsLeaves", "NodesRejoined"]


class NodesAsLeaves:
    """The default strategy over a ``RaptorIndex`` whose leaves are ``SentenceSplitter()`` nodes."""

    rejoin = False

    def __init__(self, corpus: Any) -> None:
        self.index = RaptorIndex(
            self.items(corpus),
            embed_model=corpus.embedder,
            tokenizer=corpus.tokenizer,
            random_state=corpus.random_state,
            **self.options(),
        )
        self._retrievers: dict[int, Any] = {}

    @staticmethod
    def items(corpus: Any) -> list[Any]:
        """What the index is built from: each document's ``SentenceSplitter()`` nodes."""
        documents = [Document(text=d.text, id_=d.doc_id) for d in corpus.documents]
        return SentenceSplitter().get_nodes_from_documents(documents)

    def options(self) -> dict[str, Any]:
        """``RaptorIndex`` options that differ between the retrievers."""
        return {"rejoin_nodes": self.rejoin}

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Passage texts, best first, within ``max_tokens``."""
        retriever = self._retrievers.get(max_tokens)
        if retriever is None:
            retriever = self.index.as_retriever(max_tokens=max_tokens, similarity_top_k=1000)
            self._retrievers[max_tokens] = retriever
        return [hit.node.get_content() for hit in retriever.retrieve(question)]


class NodesRejoined(NodesAsLeaves):
    """The same, with ``rejoin_nodes=True``: RAPTOR's own chunks of the rejoined documents."""

    rejoin = True
