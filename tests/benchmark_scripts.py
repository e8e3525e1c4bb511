"""Run a script of benchmarks/ as a user would, in a process of its own.

The process is forked from the session's warm interpreter (tests/warm_python.py), which has
torch and the frameworks imported already.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from warm_python import warm_python

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/<script> <args>``, offline, with this checkout importable."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    path = ROOT / "benchmarks" / script
    return warm_python().run(
        [str(path), *args], script=path, cwd=os.getcwd(), env=env, timeout=timeout
    )
