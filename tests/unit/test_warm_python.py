"""The warm interpreter (tests/warm_python.py) runs code as a fresh ``python`` would.

The documentation, example and CLI tests trust it to report exit statuses, output and
timeouts faithfully: a block that fails must fail its test.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from warm_python import IMPORT_TIME_ENV, RAPTOR, WarmPython, raptor, warm_python

pytestmark = pytest.mark.skipif(
    os.environ.get("RAPTOR_TESTS_FRESH") == "1", reason="RAPTOR_TESTS_FRESH=1: no warm server"
)


def run(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    assert isinstance(warm_python(), WarmPython)
    return warm_python().run(
        ["-c", "x"], code=code, cwd=tmp_path, env={**os.environ, **env}, timeout=60
    )


def test_status_output_argv_cwd_and_environment(tmp_path: Path) -> None:
    proc = run(
        "import os, sys\n"
        "print('out', sys.argv, os.getcwd(), os.environ['WARM_CHECK'], sys.path[0] == '')\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n",
        tmp_path,
        WARM_CHECK="yes",
    )
    assert proc.returncode == 3
    assert proc.stdout == f"out ['-c', 'x'] {tmp_path} yes True\n"
    assert proc.stderr == "err\n"
    # What one run set does not leak into the next.
    assert run("import os; print(os.environ.get('WARM_CHECK'))", tmp_path).stdout == "None\n"


def test_an_exception_fails_with_its_traceback(tmp_path: Path) -> None:
    proc = run("raise ValueError('boom')", tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("ValueError: boom")
    assert run("import sys; sys.exit('bad input')", tmp_path).returncode == 1


@pytest.mark.parametrize(
    ("code", "stdout"),
    [
        pytest.param(
            # dataclasses and pydantic look the module up in sys.modules["__main__"].
            "from __future__ import annotations\n"
            "import typing\nfrom dataclasses import dataclass\n"
            "@dataclass\nclass A:\n    x: int\n"
            "print(typing.get_type_hints(A))\n",
            "{'x': <class 'int'>}\n",
            id="classes-of-the-code-resolve-their-annotations",
        ),
        pytest.param(
            "import atexit, threading, time\n"
            "atexit.register(print, 'atexit ran')\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start()\n",
            "thread done\natexit ran\n",
            id="threads-and-atexit-finish-before-the-exit",
        ),
    ],
)
def test_code_runs_as_in_a_fresh_interpreter(code: str, stdout: str, tmp_path: Path) -> None:
    proc = run(code, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == stdout


def test_a_run_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(marker)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python().run(["-c"], code=code, cwd=tmp_path, env=dict(os.environ), timeout=3)
    assert time.monotonic() - start < 30
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert run("print('still serving')", tmp_path).stdout == "still serving\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (killed, not yet reaped by init) counts as gone.
    status = Path(f"/proc/{pid}/stat")
    return not (status.exists() and status.read_text().split(") ")[-1].startswith("Z"))


def test_scripts_and_the_console_entry_point(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    proc = warm_python().run(
        [str(script), "a"], script=script, cwd=tmp_path, env=dict(os.environ), timeout=60
    )
    assert proc.stdout == f"__main__ ['a'] {tmp_path}\n"
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert f'raptor = "{RAPTOR}"' in pyproject.split("[project.scripts]")[1].split("[")[0]
    help_ = raptor("--help", cwd=tmp_path)
    fresh = subprocess.run(
        [sys.executable, "-m", "raptor_core.cli", "--help"],
        capture_output=True, text=True, cwd=tmp_path, check=False, timeout=120,
    )  # fmt: skip
    assert (help_.returncode, help_.stdout) == (fresh.returncode, fresh.stdout)
    assert raptor("query", cwd=tmp_path).returncode == 2  # a usage error, as the command says


def test_the_server_has_what_the_cli_sets_before_its_imports() -> None:
    """A fresh ``raptor`` sets these before transformers is imported; the server must too."""
    from raptor_core.cli import app

    source = inspect.getsource(app.main)
    assert dict(re.findall(r'os\.environ\.setdefault\("(\w+)", "([^"]*)"\)', source)) == (
        IMPORT_TIME_ENV
    )


def test_quick_runs_back_to_back_each_get_their_own_reply(tmp_path: Path) -> None:
    # A run that ends at once may send its two replies before the first is read; each
    # must still be read as its own (the replies are read unbuffered).
    for i in range(20):
        assert run(f"print({i})", tmp_path).stdout == f"{i}\n"
