"""SIGKILL a build that talks to an OpenAI-compatible server, resume it, pay nothing twice.

The build runs in a subprocess (the real ``openai`` client, the build cache in
``OUT/.raptor-cache``).  The server kills it from inside a request handler, once a chosen
number of summaries has been answered, so the interruption lands at the same point every
run.  The rerun must give exactly the tree of an uninterrupted build, and the server must
not see again any request it had already answered before the kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from openai_server import (
    CORPUS,
    LOCALHOST,
    FakeOpenAIServer,
    Record,
    openai_builder,
    tree_signature,
)

from raptor_core.tree import Tree

pytestmark = [*LOCALHOST, pytest.mark.timeout(180)]

TESTS_DIR = Path(__file__).resolve().parents[1]
CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from openai_server import CORPUS, openai_builder

    url, out, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3])
    builder = openai_builder(url, max_concurrency=concurrency, cache=out + "/.raptor-cache")
    builder.build(CORPUS).save(out)
    """
)


def _run_child(script: Path, url: str, out: Path, concurrency: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    return subprocess.Popen([sys.executable, str(script), url, str(out), str(concurrency)], env=env)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_killed_build_resumes_without_paying_twice(tmp_path: Path, concurrency: int) -> None:
    kill_after = 6  # summaries answered before the kill (layer 1 has 11 clusters)
    with FakeOpenAIServer() as reference_server:
        reference = openai_builder(reference_server.url, max_concurrency=concurrency).build(CORPUS)
    n_summaries = len(reference) - len(reference.leaves)
    assert n_summaries > kill_after

    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS_DIR)), encoding="utf-8")
    out = tmp_path / "tree"
    child: dict[str, subprocess.Popen[bytes]] = {}
    killed_at: list[float] = []
    lock = threading.Lock()

    def answered(server: FakeOpenAIServer, endpoint: str) -> list[Record]:
        return [r for r in server.requests(endpoint) if r.ok and r.finished is not None]

    def kill_mid_build(record: Record) -> None:
        with lock:
            if killed_at or record.endpoint != "chat" or "proc" not in child:
                return
            if len(answered(server, "chat")) >= kill_after:
                os.kill(child["proc"].pid, signal.SIGKILL)
                killed_at.append(time.monotonic())

    with FakeOpenAIServer(delay=0.02, on_request=kill_mid_build) as server:
        with lock:
            child["proc"] = _run_child(script, server.url, out, concurrency)
        assert child["proc"].wait(timeout=90) == -signal.SIGKILL
        time.sleep(0.1)  # let the handlers still writing to the dead client finish
        assert not (out / "tree.json").exists()  # nothing half-written
        assert (out / ".raptor-cache").is_dir()
        before_kill = {
            (r.endpoint, r.key)
            for r in server.requests()
            if r.ok and r.finished is not None and r.finished < killed_at[0]
        }
        chat_before = len([key for key in before_kill if key[0] == "chat"])
        assert chat_before >= kill_after

        server.reset()
        resumed_proc = _run_child(script, server.url, out, concurrency)
        assert resumed_proc.wait(timeout=90) == 0
        resumed = Tree.load(out)
        second_run = server.requests()

    assert tree_signature(resumed) == tree_signature(reference)
    np.testing.assert_array_equal(resumed.embeddings, reference.embeddings)
    repeated = [r for r in second_run if (r.endpoint, r.key) in before_kill]
    # With one request at a time every answer is committed before the next request leaves;
    # with more, an answer can be on the wire when the process dies.
    assert len(repeated) <= (0 if concurrency == 1 else concurrency)
    assert all(r.endpoint == "chat" for r in repeated)  # leaf embeddings are never redone
    # Every summary was paid once, plus at most the repeats.
    assert chat_before + len([r for r in second_run if r.endpoint == "chat" and r.ok]) == (
        n_summaries + len(repeated)
    )
