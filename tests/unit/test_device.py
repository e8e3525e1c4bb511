"""SentenceTransformerEmbedder picks the best device (cuda, then mps, then cpu) unless told.

No test here needs a GPU: torch's availability checks are monkeypatched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import raptor_core.backends.sentence_transformers as st_backend
from raptor_core.backends.sentence_transformers import (
    DEFAULT_BATCH_SIZES,
    SentenceTransformerEmbedder,
    best_device,
)
from raptor_core.build.builder import describe
from raptor_core.components import recreate_embedder

torch = pytest.importorskip("torch")


@pytest.fixture
def devices(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set which accelerators torch reports; the per-process device choice is re-made."""

    def set_available(*, cuda: bool, mps: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
        best_device.cache_clear()

    best_device.cache_clear()
    yield set_available
    best_device.cache_clear()


@pytest.mark.parametrize(
    ("cuda", "mps", "expected"),
    [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")],
)
def test_best_device_prefers_cuda_then_mps(devices: Any, cuda: bool, mps: bool, expected: str):
    devices(cuda=cuda, mps=mps)
    assert best_device() == expected
    embedder = SentenceTransformerEmbedder()
    assert embedder.resolved_device == expected
    assert embedder.resolved_batch_size == DEFAULT_BATCH_SIZES[expected]


def test_an_explicit_device_and_batch_size_win(devices: Any) -> None:
    devices(cuda=True, mps=False)
    assert SentenceTransformerEmbedder(device="cpu").resolved_device == "cpu"
    assert SentenceTransformerEmbedder(device="cpu").resolved_batch_size == 64
    # A numbered CUDA device gets the CUDA batch size; an explicit one is kept as given.
    assert SentenceTransformerEmbedder(device="cuda:1").resolved_batch_size == 256
    assert SentenceTransformerEmbedder(device="cuda", batch_size=8).resolved_batch_size == 8


def test_params_record_the_arguments_as_given_not_this_machine(devices: Any) -> None:
    devices(cuda=True, mps=False)
    record = describe(SentenceTransformerEmbedder())
    assert record["device"] is None and record["batch_size"] is None


def test_the_model_loads_on_the_resolved_device(
    devices: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    devices(cuda=False, mps=True)
    loaded: list[str] = []

    def fake_load(self: SentenceTransformerEmbedder, target: str, local: bool, device: str):
        loaded.append(device)
        return object()

    monkeypatch.setattr(st_backend, "_MODELS", {})
    monkeypatch.setattr(SentenceTransformerEmbedder, "_load", fake_load)
    SentenceTransformerEmbedder().model  # noqa: B018 - loading is the point
    SentenceTransformerEmbedder(device="cpu").model  # noqa: B018
    assert loaded == ["mps", "cpu"]


def test_a_tree_built_on_a_gpu_loads_here(devices: Any, st_embedder: Any) -> None:
    """The record of a GPU build (device and batch size as the user gave them) loads on a CPU."""
    devices(cuda=False, mps=False)
    record = describe(SentenceTransformerEmbedder(device="cuda:0", batch_size=None))
    assert record["device"] == "cuda:0"
    embedder = recreate_embedder(record, dim=384)
    assert isinstance(embedder, SentenceTransformerEmbedder)
    assert embedder.device is None and embedder.resolved_device == "cpu"
    vector = embedder.embed_query("a cat sat on the mat")
    expected = st_embedder.embed_query("a cat sat on the mat")
    assert vector.shape == (384,)
    np.testing.assert_allclose(vector, expected, atol=1e-5)
