"""The query path stays light: nothing on it imports UMAP, numba, scikit-learn or a framework."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raptor_core.backends.onnx import OnnxEmbedder, default_onnx_dir, export_info
from raptor_core.cli.models import _default_onnx, parse_embedder_spec
from raptor_core.exceptions import EmbeddingError
from raptor_core.testing import tiny_tree
from raptor_core.tree import Tree

#: Imported by a build or by the adapters, never by answering a query.
HEAVY = ("umap", "numba", "pynndescent", "sklearn", "llama_index", "langchain", "langchain_core")

QUERY_IN_A_NEW_PROCESS = """
import json, sys
from raptor_core.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))
"""


def run_query_process(args: list[str], env: dict[str, str]) -> tuple[list[dict], list[str]]:
    """Run ``raptor query ARGS --json`` in a fresh interpreter: (hits, heavy modules imported)."""
    code = QUERY_IN_A_NEW_PROCESS.format(heavy=set(HEAVY) | {"torch", "sentence_transformers"})
    out = subprocess.run(
        [sys.executable, "-c", code, "query", *args, "--json"],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=300,
    ).stdout
    hits_text, _, modules_line = out.rstrip().rpartition("\n")
    return json.loads(hits_text), json.loads(modules_line)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    repo = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": repo + (os.pathsep + path if path else ""),
        "RAPTOR_ONNX_DIR": str(tmp_path / "no-export-here"),
        "HF_HUB_OFFLINE": "1",
    }


def test_raptor_query_imports_nothing_heavy(tmp_path: Path, env: dict[str, str]) -> None:
    tree_dir = tmp_path / "tree"
    tiny_tree().save(tree_dir)
    hits, imported = run_query_process([str(tree_dir), "cats", "-k", "2"], env)
    assert len(hits) == 2
    assert imported == []  # nor torch: the tree's FakeEmbedder needs no model


def test_onnx_spec_and_missing_export(tmp_path: Path) -> None:
    assert parse_embedder_spec("onnx:/models/minilm") == ("onnx", "/models/minilm")
    assert export_info(tmp_path) is None
    with pytest.raises(EmbeddingError, match="export_onnx"):
        OnnxEmbedder(tmp_path).embed_query("cats")


@pytest.mark.parametrize(
    "meta",
    [
        {"format": 99, "model_name_or_path": "m", "dim": 4, "max_seq_length": 8, "normalize": True},
        {"format": 1, "model_name_or_path": "m", "dim": -4, "max_seq_length": 8, "normalize": True},
        {"format": 1, "model_name_or_path": "m", "dim": 4, "max_seq_length": True, "normalize": 1},
        {"format": 1, "model_name_or_path": 3, "dim": 4, "max_seq_length": 8, "normalize": True},
        ["not", "an", "object"],
    ],
)
def test_an_invalid_export_description_is_refused(tmp_path: Path, meta: object) -> None:
    for name in ("model.onnx", "tokenizer.json"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "raptor-onnx.json").write_text(json.dumps(meta))
    assert export_info(tmp_path) is None
    with pytest.raises(EmbeddingError, match=r"raptor-onnx\.json"):
        OnnxEmbedder(tmp_path).embed_query("cats")


def test_default_onnx_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPTOR_ONNX_DIR", "/srv/onnx")
    assert default_onnx_dir() == Path("/srv/onnx")
    monkeypatch.delenv("RAPTOR_ONNX_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/me")
    assert default_onnx_dir() == Path("/var/cache/me/raptor-retriever/onnx/all-MiniLM-L6-v2")


def fake_export(directory: Path, model: str) -> None:
    directory.mkdir(parents=True)
    for name in ("model.onnx", "tokenizer.json"):
        (directory / name).write_bytes(b"")
    meta = {"format": 1, "model_name_or_path": model, "dim": 384, "max_seq_length": 256}
    (directory / "raptor-onnx.json").write_text(json.dumps({**meta, "normalize": True}))


def st_tree(model: str) -> Tree:
    record = {
        "class": "raptor_core.backends.sentence_transformers.SentenceTransformerEmbedder",
        "model_name_or_path": model,
        "normalize": True,
        "query_prompt": "query: ",
    }
    tree = tiny_tree()
    return Tree(nodes=tree.nodes, embeddings=tree.embeddings, params={"embedder": record})


def test_the_default_export_is_used_only_for_the_default_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAPTOR_ONNX_DIR", str(tmp_path / "export"))
    assert _default_onnx(st_tree("all-MiniLM-L6-v2")) is None  # nothing exported yet
    fake_export(tmp_path / "export", "all-MiniLM-L6-v2")
    embedder = _default_onnx(st_tree("all-MiniLM-L6-v2"))
    assert isinstance(embedder, OnnxEmbedder)
    assert embedder.onnx_dir == tmp_path / "export" and embedder.query_prompt == "query: "
    assert _default_onnx(st_tree("BAAI/bge-small-en-v1.5")) is None  # another model
    assert _default_onnx(tiny_tree()) is None  # a FakeEmbedder tree


def test_an_export_of_another_model_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAPTOR_ONNX_DIR", str(tmp_path / "export"))
    fake_export(tmp_path / "export", "BAAI/bge-small-en-v1.5")
    assert _default_onnx(st_tree("all-MiniLM-L6-v2")) is None


def test_export_onnx_command_writes_where_query_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import raptor_core.backends.onnx as onnx_backend
    from raptor_core.cli import main

    calls: list[tuple[Path, str]] = []

    def fake_export(out_dir: Path, model: str) -> Path:
        calls.append((Path(out_dir), model))
        return Path(out_dir)

    monkeypatch.setattr(onnx_backend, "export_onnx", fake_export)
    monkeypatch.setenv("RAPTOR_ONNX_DIR", str(tmp_path / "default"))
    assert main(["export-onnx"]) in (0, None)
    assert main(["export-onnx", "--out", str(tmp_path / "x"), "--model", "m"]) in (0, None)
    assert calls == [(tmp_path / "default", "all-MiniLM-L6-v2"), (tmp_path / "x", "m")]
    assert "raptor query` now embeds" in capsys.readouterr().out


def test_export_onnx_command_hides_torchs_optional_operator_warnings(tmp_path: Path) -> None:
    # torch's exporter warns once per torchvision operator it cannot register: four lines of
    # noise on every `raptor export-onnx` where torchvision is not installed.
    pytest.importorskip("torch")
    import logging

    import raptor_core.backends.onnx as onnx_backend
    from raptor_core.cli import main

    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    def fake_export(out_dir: Path, model: str) -> Path:
        registration.warning("torchvision is not installed. Skipping torchvision::nms")
        registration.error("a real failure")
        return Path(out_dir)

    onnx_logger = logging.getLogger("torch.onnx")
    level = onnx_logger.level
    handler = Collect()
    registration.addHandler(handler)
    real_export = onnx_backend.export_onnx
    onnx_backend.export_onnx = fake_export  # type: ignore[assignment]
    try:
        assert main(["export-onnx", "--out", str(tmp_path)]) in (0, None)
    finally:
        onnx_backend.export_onnx = real_export
        registration.removeHandler(handler)
        onnx_logger.setLevel(level)
    assert seen == ["a real failure"]


def test_a_missing_onnxruntime_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raptor_core.exceptions import MissingDependencyError

    fake_export(tmp_path / "export", "all-MiniLM-L6-v2")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    with pytest.raises(MissingDependencyError, match=r"raptor-retriever\[onnx\]"):
        OnnxEmbedder(tmp_path / "export").embed_query("cats")
