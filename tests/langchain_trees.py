"""Small LangChain documents and fast build options shared by the adapter's store tests."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from raptor_core.testing import FakeEmbedder

__all__ = ["TieFreeEmbedder", "fast_build_options", "lc_documents"]


class TieFreeEmbedder(FakeEmbedder):
    """The tree's fake model, with queries nudged off the bag-of-words ties at score 0.

    Which of several exactly tied nodes a store ranks first is its own business.
    """

    def embed_query(self, text: str) -> NDArray[np.float32]:
        q = super().embed_query(text)
        nudge = np.random.default_rng(1234).standard_normal(q.shape[0]).astype(np.float32)
        q = q + 0.05 * nudge / np.linalg.norm(nudge)
        return (q / np.linalg.norm(q)).astype(np.float32)


def fast_build_options() -> dict[str, Any]:
    from raptor_core.testing import EchoSummarizer, GroupClusterer, WhitespaceTokenizer

    return {
        "tokenizer": WhitespaceTokenizer(),
        "clusterer": GroupClusterer(2),
        "summarizer": EchoSummarizer(),
        "chunk_max_tokens": 8,
        "min_layer_size": 2,
        "max_layers": 2,
    }


def lc_documents() -> list[Any]:
    from langchain_core.documents import Document

    return [
        Document(id="bees", metadata={"topic": "nature"},
                 page_content="Bees dance to show where flowers are. Bees make honey from "
                 "nectar. The queen lays eggs all summer."),
        Document(id="rockets", metadata={"topic": "space"},
                 page_content="Rockets burn fuel and oxidiser. Rockets reach orbit at eight "
                 "kilometres per second. Boosters land on barges."),
        Document(id="lava", metadata={"topic": "nature"},
                 page_content="Volcanoes erupt lava and ash. Ash clouds ground aircraft for "
                 "days. Lava cools into basalt."),
    ]  # fmt: skip
