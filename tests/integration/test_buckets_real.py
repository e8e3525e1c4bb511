"""Bucketed clustering through the real parts: MiniLM vectors, UMAP/GMM, the extractive summariser."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import raptor_core.build.clustering as clustering
from raptor_core.build.builder import TreeBuilder
from raptor_core.build.clustering import BucketJob, GMMClusterer
from raptor_core.testing import check_tree_invariants

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"


def _documents(multi_topic_text: str) -> list[dict[str, str]]:
    docs = [{"doc_id": "topics", "text": multi_topic_text}]
    for path in sorted(CORPUS.iterdir()):
        if path.suffix == ".jsonl":
            for line in path.read_text(encoding="utf-8").splitlines():
                record = json.loads(line)
                docs.append({"doc_id": record["doc_id"], "text": record["text"]})
        else:
            docs.append({"doc_id": path.stem, "text": path.read_text(encoding="utf-8")})
    return docs


def test_low_bucket_size_builds_a_valid_tree(
    st_embedder, multi_topic_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket_sizes: list[int] = []
    run_bucket = clustering.cluster_bucket

    def spy(job: BucketJob) -> list[list[int]]:
        bucket_sizes.append(len(job.vectors))
        return run_bucket(job)

    monkeypatch.setattr(clustering, "cluster_bucket", spy)
    # About 55 leaves: a small bucket (and reduction_dim, so buckets are still worth clustering
    # rather than kept whole) makes several buckets of them.
    bucket_size = 24
    clusterer = GMMClusterer(reduction_dim=5, bucket_size=bucket_size, random_state=0)
    builder = TreeBuilder(st_embedder, clusterer=clusterer, random_state=0)
    tree = builder.build(_documents(multi_topic_text))

    check_tree_invariants(tree, extractive=True)
    leaves = len(tree.leaves)
    assert leaves > 2 * bucket_size  # the leaf layer was bucketed ...
    assert len(bucket_sizes) >= 3 and max(bucket_sizes) <= bucket_size
    assert tree.params["clusterer"]["bucket_size"] == bucket_size
    # ... and the layers above merge upward: each smaller than the one below.
    sizes = [len(tree.layer(i)) for i in range(tree.num_layers)]
    assert tree.num_layers >= 3
    assert all(a > b for a, b in itertools.pairwise(sizes))
    # Every summary's input fits the summariser, as without buckets.
    for layer in range(1, tree.num_layers):
        for node in tree.layer(layer):
            if len(node.children) > 1:
                children = tree.children(node.id)
                assert sum(c.token_count for c in children) <= builder.cluster_max_tokens
