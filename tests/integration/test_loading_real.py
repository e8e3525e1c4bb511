"""Loading trees through the real parts (issue 11): the packaged MiniLM and sentence-transformers.

The allowlisted path works without arguments (a tree built with the packaged model), and the
hostile variants of that same record are refused before sentence-transformers is asked; a model
directory that names a class outside sentence-transformers is refused by the real library,
because the embedder passes ``trust_remote_code=False`` explicitly.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import warm_python

from raptor_core.backends.sentence_transformers import (
    SentenceTransformerEmbedder,
    packaged_model_path,
)
from raptor_core.components import EmbedderMismatchWarning, check_embedder, embedder_for_tree
from raptor_core.exceptions import EmbeddingError, InvalidParameterError
from raptor_core.tree import Tree

pytestmark = pytest.mark.integration

QUESTION = "Who walked on the Moon in 1969?"


def raptor(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return warm_python.raptor(*args, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def saved(real_tree: Tree, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("real") / "tree"
    real_tree.save(directory)
    return directory


def forge(tree: Tree, directory: Path, **record: object) -> Path:
    params = {**tree.params, "embedder": {**tree.params["embedder"], **record}}
    Tree(nodes=tree.nodes, embeddings=tree.embeddings, params=params).save(directory)
    return directory


def test_the_packaged_model_is_recorded_and_recreated(saved: Path, real_tree: Tree) -> None:
    record = real_tree.params["embedder"]
    assert record["model_name_or_path"] == "all-MiniLM-L6-v2"
    assert record["trust_remote_code"] is False
    embedder = embedder_for_tree(Tree.load(saved))
    assert isinstance(embedder, SentenceTransformerEmbedder)
    assert embedder.embed_query(QUESTION).shape == (real_tree.dim,)


def test_raptor_query_needs_no_embedder_for_the_packaged_model(saved: Path) -> None:
    proc = raptor("query", str(saved), QUESTION, "-k", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    hits = json.loads(proc.stdout)
    assert hits and any("moon" in h["text"].lower() for h in hits)
    explicit = raptor(
        "query", str(saved), QUESTION, "-k", "3", "--json", "--embedder", "all-MiniLM-L6-v2"
    )
    assert explicit.returncode == 0 and json.loads(explicit.stdout) == hits
    assert explicit.stderr == ""  # the same model: no mismatch warning


def test_the_adapters_load_the_packaged_model_by_themselves(saved: Path) -> None:
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from raptor_langchain import RaptorRetriever as LangChainRetriever
    from raptor_llamaindex import RaptorIndex

    docs = LangChainRetriever.from_tree(saved, k=3).invoke(QUESTION)
    assert any("moon" in d.page_content.lower() for d in docs)
    # The same search on both sides: LangChain's retriever has no budget by default.
    nodes = (
        RaptorIndex.load(saved).as_retriever(similarity_top_k=3, max_tokens=None).retrieve(QUESTION)
    )
    assert [n.node.node_id for n in nodes] == [d.id for d in docs]


def test_hostile_variants_of_the_real_record_are_refused(
    real_tree: Tree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = forge(
        real_tree, tmp_path / "remote", model_name_or_path="someone/model", trust_remote_code=True
    )
    proc = raptor("query", str(remote), QUESTION)
    assert proc.returncode == 2 and "trust_remote_code" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1

    # The packaged name, shadowed by a directory where the user runs the command.
    shadow = forge(real_tree, tmp_path / "shadowed")
    (tmp_path / "all-MiniLM-L6-v2").mkdir()
    (tmp_path / "all-MiniLM-L6-v2" / "modules.json").write_text('[{"type": "payload.Thing"}]')
    proc = raptor("query", str(shadow), QUESTION, cwd=tmp_path)
    assert proc.returncode == 2 and "exists" in proc.stderr, proc.stderr
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidParameterError, match="exists"):
        embedder_for_tree(Tree.load(shadow))


def test_a_model_directory_cannot_name_outside_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Even a directory the user passes explicitly: the embedder never grants remote code.
    marker = tmp_path / "RAN"
    (tmp_path / "payload_module.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nclass Thing:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = tmp_path / "model"
    model.mkdir()
    modules = [{"idx": 0, "name": "0", "path": "", "type": "payload_module.Thing"}]
    (model / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(EmbeddingError, match="cannot load"):
        SentenceTransformerEmbedder(str(model)).embed_query("x")
    assert not marker.exists() and "payload_module" not in sys.modules


def test_the_packaged_path_counts_as_the_packaged_model(real_tree: Tree) -> None:
    packaged = packaged_model_path()
    if packaged is None:
        pytest.skip("the packaged model is not installed")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", EmbedderMismatchWarning)
        check_embedder(real_tree, SentenceTransformerEmbedder(str(packaged)))
