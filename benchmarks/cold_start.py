"""Cold start: ``raptor query TREE "q"`` in a new process, against ``python -c "import numpy"``.

Builds a small tree with the default model (all-MiniLM-L6-v2) from ``tests/data``, exports
the model to ONNX in a temporary directory (``raptor export-onnx``), then times, each in a
fresh process and interleaved run by run so they share the machine's load:

* ``python -c "import numpy"``: the floor any numpy program pays (the baseline);
* ``python -c "import raptor_core.cli"``: the library and its command line;
* ``raptor query`` embedding through ONNX Runtime (the default once the model is exported);
* ``raptor query --no-onnx`` embedding through sentence-transformers (torch), as before.

Wall times are medians; ratios are to the numpy baseline of the same run.

Usage:
    python benchmarks/cold_start.py [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wall(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else ""),
        "HF_HUB_OFFLINE": "1",
    }
    raptor = [sys.executable, "-m", "raptor_core.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        tree, export = Path(tmp) / "tree", Path(tmp) / "onnx"
        source = ROOT / "tests" / "data" / "multi_topic.md"
        subprocess.run([*raptor, "build", str(source), "--out", str(tree)], env=env, check=True)
        subprocess.run([*raptor, "export-onnx", "--out", str(export)], env=env, check=True)
        env["RAPTOR_ONNX_DIR"] = str(export)
        question = [str(tree), "what do cats do all day?", "-k", "3"]
        runs = {
            'python -c "import numpy" (baseline)': [sys.executable, "-c", "import numpy"],
            'python -c "import raptor_core.cli"': [sys.executable, "-c", "import raptor_core.cli"],
            "raptor query (ONNX Runtime: now)": [*raptor, "query", *question],
            "raptor query --no-onnx (sentence-transformers)": [
                *raptor,
                "query",
                *question,
                "--no-onnx",
            ],
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.runs):
            for name, cmd in runs.items():
                times[name].append(wall(cmd, env))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians['python -c "import numpy" (baseline)']
    print(
        f"# cold start, median of {args.runs} fresh processes each; {platform.platform()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"load average at end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    width = max(len(n) for n in medians)
    for name, seconds in medians.items():
        spread = f"{min(times[name]):.2f}-{max(times[name]):.2f}"
        print(f"{name:<{width}}  {seconds:6.2f} s  ({spread})  {seconds / base:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"median_s": medians, "runs": times}, indent=2))


if __name__ == "__main__":
    main()
