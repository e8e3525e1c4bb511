"""LlamaIndex's default retriever as an evaluation baseline for ``raptor eval``.

``VectorStoreIndex(nodes, embed_model=...).as_retriever(similarity_top_k=k)`` is what the
LlamaIndex starter tutorial builds: an in-memory ``SimpleVectorStore`` ranked by cosine
similarity.  Two variants are registered (entry-point group ``raptor.eval_baselines``):

* ``llamaindex-vector``: over the RAPTOR tree's own leaf chunks (~100 tokens), so the only
  difference from RAPTOR is the tree;
* ``llamaindex-vector-default-chunking``: over LlamaIndex's default chunking,
  ``SentenceSplitter()`` (1,024-token chunks, 200 overlap).

Both embed with the evaluation's embedding model, wrapped in
:class:`~raptor_llamaindex.models.RaptorEmbedding`; ``similarity_top_k`` is set high
enough to fill the budget, and the harness cuts the ranked list at the budget.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import BaseNode, TextNode

from raptor_core.evaluation.baselines import candidate_k
from raptor_llamaindex.models import RaptorEmbedding

if TYPE_CHECKING:
    from raptor_core.evaluation.runner import EvalCorpus

__all__ = ["VectorStoreBaseline", "VectorStoreDefaultChunkingBaseline"]


class VectorStoreBaseline:
    """``VectorStoreIndex(...).as_retriever()`` over the RAPTOR tree's leaf chunks.

    Setup:
        ``pip install 'raptor-retriever[llamaindex]'``

    Key init args:
        corpus: an :class:`~raptor_core.evaluation.runner.EvalCorpus` (documents, tree,
            embedder); built by ``raptor_core.evaluation.evaluate``.

    Usage:
        .. code-block:: python

            from raptor_core.evaluation import evaluate

            evaluate(docs, questions, retrievers=["collapsed", "llamaindex-vector"])
    """

    #: ``"tree"``: the tree's leaves; ``"default"``: ``SentenceSplitter()`` chunks.
    chunking = "tree"

    def __init__(self, corpus: EvalCorpus) -> None:
        self.nodes = self._nodes(corpus)
        self.index = VectorStoreIndex(self.nodes, embed_model=RaptorEmbedding(corpus.embedder))
        self._retrievers: dict[int, object] = {}

    def _nodes(self, corpus: EvalCorpus) -> list[BaseNode]:
        if self.chunking == "tree":
            return [TextNode(text=leaf.text, id_=leaf.id) for leaf in corpus.tree.leaves]
        documents = [Document(text=d.text, id_=d.doc_id) for d in corpus.documents]
        return SentenceSplitter().get_nodes_from_documents(documents)

    def retrieve(self, question: str, *, max_tokens: int) -> list[str]:
        """Node texts ranked by the default retriever, best first."""
        if not self.nodes:
            return []
        k = candidate_k(max_tokens, len(self.nodes))
        retriever = self._retrievers.get(k)
        if retriever is None:
            retriever = self.index.as_retriever(similarity_top_k=k)
            self._retrievers[k] = retriever
        return [hit.node.get_content() for hit in retriever.retrieve(question)]  # type: ignore[attr-defined]


class VectorStoreDefaultChunkingBaseline(VectorStoreBaseline):
    """``VectorStoreIndex(...).as_retriever()`` over LlamaIndex's default ``SentenceSplitter()``."""

    chunking = "default"
