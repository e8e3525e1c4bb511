"""Run Python code, scripts and the ``raptor`` command in processes forked from a warm interpreter.

Tests that run what a user runs (a documentation block, an example, a ``raptor`` command) need
a process of its own: its own ``sys.argv``, working directory, environment, exit status and
output.  A fresh interpreter spends 5 to 15 seconds of this machine's CPU importing torch,
sentence-transformers, UMAP (numba) and the frameworks before the first line of the user's
code; the suite starts about a hundred of them.

So one server interpreter imports those modules once (nothing else: no model is loaded, no
thread pool started, so a fork is as safe as a multiprocessing worker's) and forks a child per
run.  The child takes the run's working directory, environment, ``sys.argv`` and ``sys.path[0]``
as ``python -c`` / ``python script.py`` / the console script would set them, writes stdout and
stderr to files of its own, runs in a process group of its own (a timeout kills it and
everything it started), and exits as the interpreter does (non-daemon threads joined, atexit
handlers run, output flushed), less the teardown of the modules.

What a fork cannot give: environment variables that a module reads when it is imported take
the server's values for the preloaded modules.  The server starts with the test process's
environment plus :data:`IMPORT_TIME_ENV`, the variables ``raptor``'s ``main()`` sets before
anything imports transformers (a fresh ``raptor`` process reads them in time; a fork would
not).  tests/integration/test_cli_inputs.py still checks a fresh ``raptor`` process's
stderr.  Tests that check what a fresh process imports or how it starts
(tests/unit/test_query_imports.py, the ``python -m`` checks) keep using ``subprocess``.

``RAPTOR_TESTS_FRESH=1`` runs every one of these in a fresh interpreter instead, as before
the warm one existed: the check that the fork hides nothing (slow: minutes more).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Imported once by the server: what the runs spend their start-up on.
PRELOAD = (
    "numpy",
    "scipy.linalg",
    "sklearn.mixture",
    "torch",
    "sentence_transformers",
    "umap",
    "faiss",
    "tiktoken",
    "llama_index.core",
    "langchain_core.retrievers",
    "langchain_core.vectorstores",
    "raptor_core",
    "raptor_core.cli.app",
    "raptor_core.build.builder",
    "raptor_core.backends.sentence_transformers",
)
HERE = Path(__file__).resolve()
#: What raptor_core.cli.app.main sets by default, and huggingface_hub / transformers read when
#: imported: offline, no tokenizer thread pool, no progress bars of their own.
IMPORT_TIME_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


class WarmPython:
    """A server interpreter with :data:`PRELOAD` imported; :meth:`run` forks it once per call."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self._server = subprocess.Popen(
            [sys.executable, str(HERE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Unbuffered: a buffered readline could take two replies at once, and select()
            # would then wait for the second, which is already read.
            bufsize=0,
            env={**(os.environ if env is None else env), **IMPORT_TIME_ENV},
            cwd=str(HERE.parent),
        )
        assert self._server.stdout is not None and self._server.stdin is not None
        self._replies = self._server.stdout
        self._requests = self._server.stdin
        ready = self._read_reply(timeout=300)
        if ready.get("ready") is not True:
            raise RuntimeError(f"the warm interpreter did not start: {ready}")

    def run(
        self,
        argv: Sequence[str],
        *,
        code: str | None = None,
        script: str | Path | None = None,
        console: str | None = None,
        cwd: str | Path,
        env: Mapping[str, str],
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        """Run one of ``code`` (``python -c``), ``script`` or ``console`` (an entry point as
        ``module:function``) in a forked child; return what :func:`subprocess.run` would.

        ``argv`` is the command line to report and to give the child as ``sys.argv`` (without
        the interpreter, as Python itself sets it).

        Raises:
            subprocess.TimeoutExpired: the child ran longer than ``timeout`` (it is killed
                with its process group first).
        """
        with self._lock, tempfile.TemporaryDirectory(prefix="warm-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {
                "argv": list(argv),
                "code": code,
                "script": None if script is None else str(script),
                "console": console,
                "cwd": str(cwd),
                "env": dict(env),
                "stdout": str(out),
                "stderr": str(err),
            }
            pid = None
            try:
                self._requests.write((json.dumps(request) + "\n").encode())
                self._requests.flush()
                pid = int(self._read_reply(timeout=60)["pid"])
                status = int(self._read_reply(timeout=timeout)["returncode"])
            except subprocess.TimeoutExpired:
                if pid is None:
                    self.kill()
                    raise
                _kill_group(pid)
                self._read_reply(timeout=60)  # the server reaps it and reports
                raise subprocess.TimeoutExpired(list(argv), timeout) from None
            except BaseException:
                # Interrupted mid-run (a test's timeout, Ctrl-C): the replies are out of step,
                # so this server is done; warm_python() starts another.
                if pid is not None:
                    _kill_group(pid)
                self.kill()
                raise
            read = lambda p: p.read_text(encoding="utf-8", errors="replace")  # noqa: E731
            return subprocess.CompletedProcess(list(argv), status, read(out), read(err))

    @property
    def alive(self) -> bool:
        return self._server.poll() is None

    def kill(self) -> None:
        self._server.kill()
        self._server.wait()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._requests.close()
        try:
            self._server.wait(30)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()

    def _read_reply(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._replies], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired("warm interpreter", timeout)
        line = self._replies.readline()
        if not line:
            raise RuntimeError(f"the warm interpreter exited ({self._server.poll()})")
        return dict(json.loads(line))


def _kill_group(pid: int) -> None:
    # The child makes itself a process group first thing; until then, it is alone.
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


class FreshPython:
    """:meth:`WarmPython.run` in a fresh interpreter each time (``RAPTOR_TESTS_FRESH=1``)."""

    def run(
        self,
        argv: Sequence[str],
        *,
        code: str | None = None,
        script: str | Path | None = None,
        console: str | None = None,
        cwd: str | Path,
        env: Mapping[str, str],
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        if code is not None:
            command = [sys.executable, "-c", code, *argv[1:]]
        elif script is not None:
            command = [sys.executable, str(script), *argv[1:]]
        else:
            assert console is not None
            module, _, function = console.partition(":")
            entry = f"import sys; from {module} import {function}; sys.exit({function}())"
            command = [sys.executable, "-c", entry, *argv[1:]]
        proc = subprocess.run(
            command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
        return subprocess.CompletedProcess(list(argv), proc.returncode, proc.stdout, proc.stderr)


_SHARED: WarmPython | None = None
RAPTOR = "raptor_core.cli:main"  # the `raptor` console script (pyproject.toml)


def warm_python() -> WarmPython | FreshPython:
    """The test session's warm interpreter, started on first use and stopped at exit."""
    global _SHARED
    if os.environ.get("RAPTOR_TESTS_FRESH") == "1":
        return FreshPython()
    if _SHARED is None or not _SHARED.alive:
        _SHARED = WarmPython()
        atexit.register(_SHARED.close)
    return _SHARED


def raptor(
    *args: str,
    cwd: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``raptor ARGS...`` as the console script runs it, in a forked child.

    ``cwd`` defaults to this process's working directory; ``env`` adds to this process's
    environment, with ``HF_HUB_OFFLINE=1``.
    """
    environ = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return warm_python().run(
        ["raptor", *args], console=RAPTOR, cwd=cwd or os.getcwd(), env=environ, timeout=timeout
    )


# --- the server side -------------------------------------------------------------------------


def _child(request: dict[str, Any]) -> int:
    """Become the requested process; return its exit status."""
    import runpy
    import traceback
    import types

    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.argv = list(request["argv"])
    # PYTHONPATH as the run gives it; the server's own entries stay (they only add modules).
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = [p for p in extra if p not in sys.path]
    try:
        if request["code"] is not None:
            sys.path[0] = ""  # as `python -c` sets it: the working directory
            # A module of its own, so that classes defined in the code resolve their
            # annotations (dataclasses, pydantic) through sys.modules["__main__"].
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(request["code"], "<string>", "exec"), main.__dict__)
        elif request["script"] is not None:
            sys.path[0] = str(Path(request["script"]).resolve().parent)
            runpy.run_path(request["script"], run_name="__main__")
        else:
            module, _, function = request["console"].partition(":")
            entry = getattr(__import__(module, fromlist=[function]), function)
            return _status(entry())
    except SystemExit as exit_:
        return _status(exit_.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _status(code: object) -> int:
    # What the interpreter makes of `sys.exit(code)`.
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _exit(status: int) -> None:
    """Leave as the interpreter does at exit, less the module teardown.

    Tearing down the preloaded modules touches every object they made, and on a forked
    heap that copies it page by page: seconds per run.  Non-daemon threads are joined and
    atexit handlers run first, as at a normal exit (``threading._shutdown`` is the step
    the interpreter itself takes).
    """
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _serve() -> None:
    import gc

    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    # Keep the collector off the preloaded objects, so a child does not copy their pages.
    gc.freeze()
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else reaches the reply pipe

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _exit(_child(request))
        reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        reply({"returncode": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    _serve()
