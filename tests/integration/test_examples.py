"""The numbered examples run as users would run them (offline; 02 against a local server).

Each runs as ``python examples/NN_name.py`` would, in a process forked from the session's warm
interpreter (tests/warm_python.py), so it does not spend its time importing torch again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from openai_server import FakeOpenAIServer
from warm_python import warm_python

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _run(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    merged = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    path = EXAMPLES / script
    return warm_python().run([str(path), *args], script=path, cwd=ROOT, env=merged, timeout=600)


def test_every_example_is_tested() -> None:
    names = sorted(p.name for p in EXAMPLES.glob("[0-9][0-9]_*.py"))
    assert names == [
        "01_quickstart_offline.py",
        "02_openai_compatible.py",
        "03_llamaindex.py",
        "04_langchain.py",
        "05_persist_and_load.py",
        "07_langchain_chroma.py",
        "08_llamaindex_chroma.py",
    ]


def test_01_quickstart_offline() -> None:
    proc = _run("01_quickstart_offline.py")
    assert proc.returncode == 0, proc.stderr
    detail, theme = proc.stdout.split("What are the broad subjects")
    assert "1883" in detail  # the best passage holds the answer
    assert "layers [0, 1]" in theme  # and the collapsed tree ranks summaries with the chunks


def test_02_openai_compatible_against_local_server(tmp_path: Path) -> None:
    with FakeOpenAIServer() as server:
        env = {
            "OPENAI_BASE_URL": server.url,
            "OPENAI_API_KEY": "sk-example-test",
            "RAPTOR_CHAT_MODEL": "fake-chat",
            "RAPTOR_EMBED_MODEL": "fake-embed",
            "RAPTOR_OUT": str(tmp_path / "tree"),
        }
        proc = _run("02_openai_compatible.py", str(ROOT / "tests" / "data" / "corpus"), env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert server.successes("chat") and server.successes("embeddings")
        assert "sk-example-test" not in proc.stdout + proc.stderr
        paid = len(server.requests("chat"))
        again = _run("02_openai_compatible.py", str(ROOT / "tests" / "data" / "corpus"), env=env)
        assert again.returncode == 0, again.stderr
        assert len(server.requests("chat")) == paid  # the build cache answered everything


def test_02_without_configuration_says_what_to_set() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "02_openai_compatible.py")],
        capture_output=True, text=True, env=env, timeout=60, check=False, cwd=ROOT,
    )  # fmt: skip
    assert "OPENAI_API_KEY" in proc.stdout + proc.stderr


def test_03_llamaindex() -> None:
    proc = _run("03_llamaindex.py")
    assert proc.returncode == 0, proc.stderr
    assert "VectorStoreIndex" in proc.stdout


def test_04_langchain() -> None:
    proc = _run("04_langchain.py")
    assert proc.returncode == 0, proc.stderr
    assert "InMemoryVectorStore" in proc.stdout


def test_05_persist_and_load() -> None:
    proc = _run("05_persist_and_load.py")
    assert proc.returncode == 0, proc.stderr
    assert "damaged tree refused" in proc.stdout
    reloaded = proc.stdout.split("top hit after reload:")[1].splitlines()[0]
    assert f"top hit, opened lazily:{reloaded}" in proc.stdout


def test_07_langchain_chroma_against_the_server(chroma_server) -> None:  # type: ignore[no-untyped-def]
    env = {"CHROMA_HOST": chroma_server.host, "CHROMA_PORT": str(chroma_server.port)}
    proc = _run("07_langchain_chroma.py", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "into Chroma collection" in proc.stdout
    assert "Chroma.similarity_search" in proc.stdout
    # The example removes its collection from a shared server.
    assert not [c for c in chroma_server.client().list_collections() if "essays-raptor" in c.name]


def test_08_llamaindex_chroma_against_the_server(chroma_server) -> None:  # type: ignore[no-untyped-def]
    env = {"CHROMA_HOST": chroma_server.host, "CHROMA_PORT": str(chroma_server.port)}
    proc = _run("08_llamaindex_chroma.py", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "into Chroma collection" in proc.stdout
    assert "reopened: RaptorIndex(ChromaVectorStore" in proc.stdout
    assert "CHILD links" in proc.stdout
    # The example removes its collection from a shared server.
    assert not [
        c for c in chroma_server.client().list_collections() if "essays-raptor-li" in c.name
    ]
