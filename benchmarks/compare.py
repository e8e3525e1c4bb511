"""Compare a change to a retriever against a run of quality.py: paired, per set, budget and half.

A retrieval change is measured by running quality.py twice over the same data and tree cache:
once before the change with every retriever (BASE), once after it with only the retriever
that changed (NEW, ``--retrievers passage``: a minute or two instead of ten, because the
trees come from the cache).  This script pairs the two runs question by question:

    python benchmarks/quality.py --limit-docs 0 --limit-questions 0 --cache C --out BASE
    # ... change the code ...
    python benchmarks/quality.py --limit-docs 0 --limit-questions 0 --cache C --out NEW \\
        --retrievers passage
    python benchmarks/compare.py BASE NEW

For each set (its primary metric), budget and half of the documents (development, held-out,
all; see ``raptor_core.evaluation.data.holdout_split``) it prints the retriever's margin over
the best flat baseline before and after.  The baselines are BASE's; they did not change, so
the change of the margin is the change of the retriever's score.  The average change over the
sets comes with a 95% interval from a paired bootstrap over the questions of each set (both
runs scored the same questions, so only their differences are resampled).

``--retriever`` names the retriever compared (default: the default strategy); ``--as`` its
name in NEW when it differs (a variant registered under another name).  Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import SETS  # the sibling script, importable as a module

#: Primary metric of the sets quality.py knows, for BASE runs made before quality.json
#: recorded it (``"primary"``).
KNOWN_PRIMARY = {name: spec[1] for name, spec in SETS.items()}
HALVES = ("dev", "held-out", "all")


class CompareError(Exception):
    """The two runs cannot be compared (what is missing is in the message)."""


def _read(path: Path, hint: str) -> dict[str, Any]:
    """The JSON object in ``path``; else CompareError with ``hint`` (what to check)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        msg = f"{path} cannot be read ({exc}): {hint}"
        raise CompareError(msg) from exc
    if not isinstance(value, dict):
        msg = f"{path} is not what quality.py writes: {hint}"
        raise CompareError(msg)
    return value


def _rows(run: Path, name: str) -> list[dict[str, Any]]:
    path = run / "quality" / name / "results.json"
    rows = _read(path, f"did quality.py --out {run} score {name!r}?").get("rows")
    if not isinstance(rows, list):
        msg = f"{path}: 'rows' is not a list"
        raise CompareError(msg)
    return rows


def _scores(
    rows: list[dict[str, Any]], retriever: str, budget: int, metric: str
) -> dict[str, tuple[str, float]]:
    """question id -> (doc id, score) of one retriever at one budget (scored questions only)."""
    return {
        str(r["question_id"]): (str(r["doc_id"]), float(r[metric]))
        for r in rows
        if r.get("retriever") == retriever
        and int(r.get("budget", -1)) == budget
        and r.get(metric) is not None
    }


def _primary(summary: dict[str, Any]) -> dict[str, str]:
    """Set name -> primary metric, as BASE's quality.json records it (or the known sets)."""
    recorded = summary.get("primary") or {}
    sets = list(summary.get("sets") or {})
    missing = [s for s in sets if s not in recorded and s not in KNOWN_PRIMARY]
    if missing:
        msg = f"BASE does not record the primary metric of {missing}; rerun quality.py for it"
        raise CompareError(msg)
    return {s: recorded.get(s) or KNOWN_PRIMARY[s] for s in sets}


def compare(
    base: Path,
    new: Path,
    *,
    retriever: str | None = None,
    new_name: str | None = None,
    draws: int = 2000,
    seed: int = 0,
) -> dict[str, Any]:
    """The margins before and after, per half, budget and set, and the average change.

    Returns ``{"retriever", "budgets", "halves": {half: {budget: {"sets": {name: {"base",
    "new", "best_flat", "questions"}}, "change", "interval"}}}}``, margins and changes in
    recall units (multiply by 100 for points).
    """
    from raptor_core.evaluation.data import holdout_split
    from raptor_core.evaluation.runner import FLAT_BASELINES

    summary = _read(base / "quality.json", "is BASE a quality.py --out folder?")
    retriever = retriever or str(summary.get("default") or "passage")
    new_name = new_name or retriever
    budgets = [int(b) for b in summary.get("budgets") or ()]
    primary = _primary(summary)
    sets = [s for s in primary if (new / "quality" / s / "results.json").is_file()]
    if not sets:
        msg = f"NEW ({new}) has no results for any set of BASE ({', '.join(primary)})"
        raise CompareError(msg)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {"retriever": retriever, "budgets": budgets, "halves": {}}
    # (set, budget) -> scores before, after, and of each flat baseline BASE ran.
    scores = {}
    for name in sets:
        metric = primary[name]
        base_rows, new_rows = _rows(base, name), _rows(new, name)
        for budget in budgets:
            before = _scores(base_rows, retriever, budget, metric)
            after = _scores(new_rows, new_name, budget, metric)
            if not before or not after:
                run, named = ("BASE", retriever) if not before else ("NEW", new_name)
                msg = f"{run} has no {metric} of {named!r} on {name} @{budget}"
                raise CompareError(msg)
            if before.keys() != after.keys():
                msg = (
                    f"{name} @{budget}: BASE and NEW scored different questions "
                    f"({len(before)} and {len(after)}); run both over the same data "
                    "and limits"
                )
                raise CompareError(msg)
            flats = [_scores(base_rows, b, budget, metric) for b in FLAT_BASELINES]
            scores[name, budget] = (before, after, flats)
    for half in HALVES:
        out["halves"][half] = {}
        for budget in budgets:
            cells: dict[str, Any] = {}
            differences = []
            for name in sets:
                before, after, flats = scores[name, budget]
                chosen = sorted(
                    q
                    for q, (doc, _) in before.items()
                    if half == "all" or holdout_split(doc) == half
                )
                if not chosen:
                    continue
                flat = []
                for scored in flats:
                    values = [scored[q][1] for q in chosen if q in scored]
                    if values:
                        flat.append(float(np.mean(values)))
                if not flat:
                    msg = f"BASE has no flat baseline for {name} @{budget}: run it with them"
                    raise CompareError(msg)
                old = np.array([before[q][1] for q in chosen])
                now = np.array([after[q][1] for q in chosen])
                best = float(max(flat))
                cells[name] = {
                    "base": float(old.mean()) - best,
                    "new": float(now.mean()) - best,
                    "best_flat": best,
                    "questions": len(chosen),
                }
                differences.append(now - old)
            if not cells:
                continue
            change = float(np.mean([d.mean() for d in differences]))
            # Each set's questions are resampled on their own; the interval is of the
            # draw-wise average over the sets, as the headline's average margin is.
            boot = np.mean(
                [
                    d[rng.integers(0, d.shape[0], (draws, d.shape[0]))].mean(axis=1)
                    for d in differences
                ],
                axis=0,
            )
            low, high = np.quantile(boot, [0.025, 0.975])
            out["halves"][half][budget] = {
                "sets": cells,
                "change": change,
                "interval": (float(low), float(high)),
            }
    return out


def to_text(result: dict[str, Any]) -> str:
    """The comparison as markdown tables, in points (hundredths of recall)."""
    lines = [
        f"`{result['retriever']}`: margin over the best flat baseline, before -> after (points)",
        "",
    ]
    budgets = result["budgets"]
    for half, by_budget in result["halves"].items():
        if not by_budget:
            continue
        names = list(next(iter(by_budget.values()))["sets"])
        lines += [f"**{half}**", "", "| set | " + " | ".join(f"@{b}" for b in budgets) + " |"]
        lines.append("|---|" + "---|" * len(budgets))
        for name in names:
            cells = []
            for b in budgets:
                cell = by_budget.get(b, {}).get("sets", {}).get(name)
                cells.append(
                    "-"
                    if cell is None
                    else f"{100 * cell['base']:+.1f} -> {100 * cell['new']:+.1f}"
                )
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        changes = []
        for b in budgets:
            cell = by_budget.get(b)
            if cell is None:
                changes.append("-")
                continue
            low, high = cell["interval"]
            changes.append(f"**{100 * cell['change']:+.1f}** ({100 * low:+.1f}, {100 * high:+.1f})")
        lines += ["| average change (95% interval) | " + " | ".join(changes) + " |", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("base", type=Path, help="quality.py --out folder of the run before")
    parser.add_argument("new", type=Path, help="quality.py --out folder of the run after")
    parser.add_argument("--retriever", default=None, help="default: BASE's default strategy")
    parser.add_argument("--as", dest="new_name", default=None, help="its name in NEW")
    parser.add_argument("--draws", type=int, default=2000, help="bootstrap draws")
    args = parser.parse_args(argv)
    if args.draws < 1:
        parser.error("--draws must be at least 1")
    try:
        result = compare(
            args.base, args.new, retriever=args.retriever, new_name=args.new_name, draws=args.draws
        )
    except CompareError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(to_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
