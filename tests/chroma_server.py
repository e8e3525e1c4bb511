"""A real Chroma server for the tests: ``chroma run`` from the chromadb package, on 127.0.0.1.

Started once per test session by the ``chroma_server`` fixture (tests/conftest.py) in a
temporary directory and stopped at the end.  Tests that use it are skipped when chromadb is
not installed (``pip install 'raptor-retriever[chroma]'``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ChromaServer:
    """A running ``chroma run`` process."""

    host: str
    port: int
    process: subprocess.Popen[bytes]
    path: Path

    def client(self) -> Any:
        """A ``chromadb.HttpClient`` for this server."""
        import chromadb

        return chromadb.HttpClient(host=self.host, port=self.port)


def _chroma_command() -> list[str]:
    script = Path(sys.executable).parent / "chroma"
    if script.exists():
        return [str(script)]
    found = shutil.which("chroma")
    if found is None:
        msg = "the `chroma` command is not installed (pip install chromadb)"
        raise RuntimeError(msg)
    return [found]


def start(path: Path, *, timeout: float = 60.0) -> ChromaServer:
    """Start ``chroma run --path PATH --host 127.0.0.1 --port P`` and wait until it answers."""
    import chromadb

    port = _free_port()
    log = (path.parent / f"chroma-{port}.log").open("wb")
    process = subprocess.Popen(
        [
            *_chroma_command(),
            "run",
            "--path",
            str(path),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            msg = f"chroma run exited with {process.returncode}; see {log.name}"
            raise RuntimeError(msg)
        try:
            chromadb.HttpClient(host="127.0.0.1", port=port).heartbeat()
            break
        except Exception:
            if time.monotonic() > deadline:
                process.kill()
                raise
            time.sleep(0.2)
    return ChromaServer(host="127.0.0.1", port=port, process=process, path=path)


def stop(server: ChromaServer) -> None:
    """Terminate the server (kill it if it does not stop within 10 s)."""
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()


class Recorder:
    """Wraps a chromadb collection's ``get``, ``query`` and ``count``, recording each ``where``.

    Chroma answers any metadata ``where`` by reading the whole collection, so the tests of
    opening a large tree assert that none was sent (``filtered == []``).
    """

    def __init__(self, collection: Any, monkeypatch: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        for method in ("get", "query", "count"):
            original = getattr(collection, method)

            def record(*args: Any, _name: str = method, _f: Any = original, **kwargs: Any) -> Any:
                self.calls.append((_name, kwargs.get("where")))
                return _f(*args, **kwargs)

            monkeypatch.setattr(collection, method, record)

    @property
    def filtered(self) -> list[tuple[str, Any]]:
        """The calls that sent a (non-empty) ``where``."""
        return [call for call in self.calls if call[1]]
