"""Reports of an :class:`~raptor_core.evaluation.runner.EvalResult`: table, JSON, markdown, plot.

rich and matplotlib are imported only when a report needs them; without rich the table is
plain text.  The plot draws on a bare ``matplotlib.figure.Figure`` with the Agg canvas, so it
never touches pyplot's global backend (safe inside notebooks and servers).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from raptor_core._imports import require
from raptor_core.evaluation.runner import FLAT_BASELINES, EvalResult
from raptor_core.exceptions import InvalidParameterError

__all__ = [
    "LABELS",
    "best_flat",
    "default_retriever",
    "format_table",
    "margin",
    "margin_draws",
    "margin_interval",
    "plot_recall",
    "print_table",
    "to_markdown",
    "write_json",
]

#: Short column labels of the metrics.
LABELS = {
    "evidence_recall": "evidence",
    "answer_recall": "answer",
    "span_recall": "span",
    "span_precision": "span prec",
    "choice_accuracy": "choice",
}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def best_flat(
    result: EvalResult,
    budget: int,
    metric: str,
    *,
    baselines: Sequence[str] = FLAT_BASELINES,
) -> tuple[str, float] | None:
    """The strongest flat baseline on ``metric`` at ``budget``: ``(name, score)``.

    Only baselines that ran and could be scored count; None when there are none.  Ties go
    to the baseline listed first in ``baselines``.
    """
    best: tuple[str, float] | None = None
    for name in baselines:
        if name not in result.retrievers:
            continue
        value = result.score(name, budget, metric)
        if value is not None and (best is None or value > best[1]):
            best = (name, value)
    return best


def margin(result: EvalResult, retriever: str, budget: int, metric: str) -> float | None:
    """``retriever``'s score minus the best flat baseline's (positive: the retriever wins)."""
    best = best_flat(result, budget, metric)
    if best is None or retriever not in result.retrievers:
        return None
    value = result.score(retriever, budget, metric)
    return None if value is None else value - best[1]


def margin_draws(
    result: EvalResult,
    retriever: str,
    budget: int,
    metric: str,
    *,
    baselines: Sequence[str] = FLAT_BASELINES,
    resamples: int = 2000,
    random_state: int = 0,
) -> NDArray[np.float64] | None:
    """Bootstrap draws of :func:`margin`: the questions resampled with replacement.

    A paired bootstrap: each draw resamples the scored questions, and every retriever is
    scored on the same resample, so what the questions have in common (an easy document, a
    hard one) cancels out of the margin.  The best baseline is chosen again in every draw,
    so the spread includes the luck of which baseline looks best.  With a few dozen
    questions one question moves a recall by several points: these draws say whether a
    margin is more than that.

    Returns ``resamples`` margins (positive: ``retriever`` wins), or None where
    :func:`margin` is None.  Draws of different sets can be averaged element-wise (same
    ``resamples``) for the spread of an average margin.
    """
    if isinstance(resamples, bool) or not isinstance(resamples, int) or resamples < 1:
        msg = f"resamples must be a positive integer, got {resamples!r}"
        raise InvalidParameterError(msg)
    names = [n for n in baselines if n in result.retrievers]
    if retriever not in result.retrievers or not names:
        return None
    # (question, retriever) scores; a question counts when every retriever scored it.
    columns = [retriever, *names]
    at = {name: j for j, name in enumerate(columns)}
    by_question: dict[str, list[float]] = {}
    for row in result.rows:
        j = at.get(row["retriever"])
        if j is None or row["budget"] != budget:
            continue
        value = row.get(metric)
        scores = by_question.setdefault(row["question_id"], [math.nan] * len(columns))
        scores[j] = math.nan if value is None else float(value)
    table = np.array([s for s in by_question.values() if not any(map(math.isnan, s))])
    if table.size == 0:
        return None
    rng = np.random.default_rng(random_state)
    picks = rng.integers(0, table.shape[0], size=(resamples, table.shape[0]))
    means = table[picks].mean(axis=1)  # (resamples, retrievers)
    return np.asarray(means[:, 0] - means[:, 1:].max(axis=1), dtype=np.float64)


def margin_interval(
    draws: NDArray[np.float64] | Sequence[NDArray[np.float64]], confidence: float = 0.95
) -> tuple[float, float]:
    """The central ``confidence`` interval of bootstrap draws (several: of their mean).

    Pass the draws of one cell from :func:`margin_draws`, or a list of draws of several
    sets for the interval of their average margin.
    """
    if not 0 < confidence < 1:
        msg = f"confidence must be in (0, 1), got {confidence!r}"
        raise InvalidParameterError(msg)
    stacked = np.atleast_2d(np.asarray(draws, dtype=np.float64))
    if stacked.size == 0:
        msg = "no draws: margin_draws returned None or nothing was passed"
        raise InvalidParameterError(msg)
    mean = stacked.mean(axis=0)
    tail = (1 - confidence) / 2
    low, high = np.quantile(mean, [tail, 1 - tail])
    return float(low), float(high)


def default_retriever(result: EvalResult) -> str | None:
    """The default RAPTOR strategy's name when it is part of ``result``, else None."""
    from raptor_core.retrieval.registry import DEFAULT_STRATEGY

    return DEFAULT_STRATEGY if DEFAULT_STRATEGY in result.retrievers else None


def _table_rows(result: EvalResult) -> tuple[list[str], list[list[str]]]:
    metrics = result.metrics
    header = ["retriever", "budget", *(LABELS[m] for m in metrics), "tokens", "ms p50", "ms p95"]
    rows = []
    for budget in result.budgets:
        for entry in (e for e in result.summary if e["budget"] == budget):
            rows.append(
                [
                    entry["retriever"],
                    str(budget),
                    *(_fmt(entry[m]) for m in metrics),
                    f"{entry['context_tokens']:.0f}",
                    f"{entry['latency_ms_p50']:.1f}",
                    f"{entry['latency_ms_p95']:.1f}",
                ]
            )
    return header, rows


def format_table(result: EvalResult) -> str:
    """The summary as a plain-text table: one row per retriever and budget."""
    header, rows = _table_rows(result)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _notes(result: EvalResult) -> list[str]:
    notes = []
    builds = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in result.builds.items())
    notes.append(f"index build: {builds}")
    embeds = [e["embed_ms_p50"] for e in result.summary if e.get("embed_ms_p50") is not None]
    if embeds:
        notes.append(
            f"query embedding: {max(embeds):.1f} ms p50, once per question and shared by all "
            "retrievers (not in their latency)"
        )
    default = default_retriever(result)
    for metric in result.metrics:
        cells = []
        for budget in result.budgets:
            best = best_flat(result, budget, metric)
            if best is None:
                continue
            text = f"@{budget} {best[1]:.3f} ({best[0]})"
            if default is not None:
                text += f", {default} {_signed(margin(result, default, budget, metric))}"
                draws = margin_draws(result, default, budget, metric)
                if draws is not None:
                    low, high = margin_interval(draws)
                    text += f" (95% {low:+.3f}..{high:+.3f})"
            cells.append(text)
        if cells:
            notes.append(f"best flat baseline, {LABELS.get(metric, metric)}: " + "; ".join(cells))
    failures = sum(int(e.get("reader_failures") or 0) for e in result.summary)
    if failures:
        notes.append(
            f"reader: {failures} answers named no option or failed (scored 0; see "
            "'reader_error' in the rows)"
        )
    notes.extend(f"skipped {name}: {reason}" for name, reason in result.skipped.items())
    return notes


def print_table(result: EvalResult, *, file: IO[str] | None = None, rich: bool = True) -> None:
    """Print the summary table (with rich when installed and ``rich`` is true), then notes."""
    header, rows = _table_rows(result)
    console = None
    if rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            console = None
        else:
            # Off a terminal rich assumes 80 columns; a table cut to fit would hide names.
            width = sum(max(len(r[i]) for r in [header, *rows]) + 3 for i in range(len(header)))
            console = Console(file=file, width=max(width + 2, 80))
            table = Table(
                title=f"{result.config.get('questions')} questions, "
                f"tree per {result.config.get('tree_per')}"
            )
            for i, name in enumerate(header):
                table.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
            last = None
            for row in rows:
                if last is not None and row[1] != last:
                    table.add_section()
                last = row[1]
                table.add_row(*row)
            console.print(table)
            for note in _notes(result):
                console.print(note, markup=False, highlight=False)
            return
    out = [format_table(result), *_notes(result)]
    print("\n".join(out), file=file)


def write_json(result: EvalResult, path: str | os.PathLike[str]) -> Path:
    """Write :meth:`EvalResult.to_dict` to ``path`` (parents created) and return the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        json.dumps(result.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return target


def to_markdown(result: EvalResult, *, metrics: Sequence[str] | None = None) -> str:
    """A markdown table: one row per retriever, ``metric @budget`` columns, then latency.

    When flat baselines ran, two rows follow: the best flat baseline per column (the
    strongest of :data:`~raptor_core.evaluation.runner.FLAT_BASELINES`, named), and the
    default strategy's margin over it.

    Args:
        result: the run.
        metrics: which metrics to show (default: all that have data).
    """
    metrics = list(result.metrics if metrics is None else metrics)
    budgets = result.budgets
    header = ["retriever"]
    for m in metrics:
        header += [f"{LABELS.get(m, m)} @{b}" for b in budgets]
    header += [f"tokens @{budgets[-1]}", f"ms p50 @{budgets[-1]}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in result.retrievers:
        cells = [name]
        for m in metrics:
            cells += [_fmt(result.score(name, b, m)) for b in budgets]
        cells.append(f"{result.score(name, budgets[-1], 'context_tokens') or 0:.0f}")
        cells.append(f"{result.score(name, budgets[-1], 'latency_ms_p50') or 0:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    if any(best_flat(result, b, m) is not None for m in metrics for b in budgets):
        cells = ["**best flat baseline**"]
        for m in metrics:
            for b in budgets:
                best = best_flat(result, b, m)
                cells.append("-" if best is None else f"{best[1]:.3f} ({best[0]})")
        lines.append("| " + " | ".join([*cells, "", ""]) + " |")
        default = default_retriever(result)
        if default is not None:
            cells = [f"**{default} − best flat**"]
            cells += [_signed(margin(result, default, b, m)) for m in metrics for b in budgets]
            lines.append("| " + " | ".join([*cells, "", ""]) + " |")
    return "\n".join(lines)


def plot_recall(
    result: EvalResult, path: str | os.PathLike[str], *, title: str | None = None
) -> Path:
    """Plot recall against token budget, one line per retriever, one panel per metric (PNG).

    Raises:
        MissingDependencyError: matplotlib is not installed.
    """
    require("matplotlib", extra="eval")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    metrics = [m for m in result.metrics if m != "span_precision"] or result.metrics
    panels = max(1, len(metrics))
    fig = Figure(figsize=(4.8 * panels, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels, squeeze=False)[0]
    budgets = result.budgets
    styles = ["-o", "-s", "-^", "-D", "-v", "--o", "--s", "--^", "--D", "--v", ":o", ":s"]
    for ax, metric in zip(axes, metrics, strict=False):
        for i, name in enumerate(result.retrievers):
            points: list[tuple[int, Any]] = [(b, result.score(name, b, metric)) for b in budgets]
            xs = [b for b, v in points if v is not None]
            ys = [v for _, v in points if v is not None]
            if xs:
                ax.plot(xs, ys, styles[i % len(styles)], label=name, linewidth=1.5, markersize=4)
        ax.set_xlabel("context budget (tokens)")
        if metric == "choice_accuracy":
            ax.set_ylabel("reader accuracy (multiple choice)")
        else:
            ax.set_ylabel(LABELS.get(metric, metric) + " recall" if "recall" in metric else metric)
        ax.set_xticks(budgets)
        ax.set_ylim(0.0, 1.02)
        ax.grid(True, alpha=0.3)
    if not metrics:
        axes[0].text(0.5, 0.5, "no scorable questions", ha="center", va="center")
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize="small")
    if title:
        fig.suptitle(title)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=120)
    return target
