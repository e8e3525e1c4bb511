"""The budget flags of ``raptor build``/``add``/``update``/``remove`` and the ETA/cost bars.

The runs through the local OpenAI-compatible server are in
``tests/integration/test_cli_budget.py``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from raptor_core.build.progress import BuildProgress
from raptor_core.cli.build import ProgressBars, _progress_bars, print_spend, progress_fields

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "corpus"


def raptor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "raptor"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "raptor_core.cli"]
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=300,
        check=False,
    )


# -- what the bars show --------------------------------------------------------------------------
def event(**kw: Any) -> BuildProgress:
    base: dict[str, Any] = {"stage": "summarize", "done": 3, "total": 10}
    return BuildProgress(**{**base, **kw})


def test_progress_fields_show_the_eta_and_the_spend() -> None:
    assert progress_fields(event(eta_s=None)) == {"eta": "eta -:--:--", "cost": ""}
    assert progress_fields(event(eta_s=83.4))["eta"] == "eta 0:01:23"
    assert progress_fields(event(eta_s=3 * 3600 + 5))["eta"] == "eta 3:00:05"
    priced = progress_fields(event(eta_s=0.0, spent_usd=0.01234, max_cost_usd=0.5))
    assert priced == {"eta": "eta 0:00:00", "cost": "$0.0123 of $0.5"}
    assert progress_fields(event(spent_usd=0.2))["cost"] == "$0.2000"
    tokens = progress_fields(event(prompt_tokens=700, completion_tokens=50, max_summary_tokens=900))
    assert tokens["cost"] == "750 of 900 tok"


def test_the_bars_draw_the_builders_eta_and_cost() -> None:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    with _progress_bars(True, console=console) as bars:
        bars(event(stage="embed", done=1, total=4, eta_s=30.0))
        bars(event(done=4, total=8, eta_s=125.0, spent_usd=0.0421, max_cost_usd=1.0))
        assert bars.last is not None
        assert bars.last.spent_usd == 0.0421
    text = out.getvalue()
    assert "eta 0:02:05" in text
    assert "$0.0421 of $1" in text
    assert "eta 0:00:30" in text


def test_hidden_bars_still_keep_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    with _progress_bars(False) as bars:
        bars(event(summary_calls=7, prompt_tokens=900, completion_tokens=70, spent_usd=0.5))
    print_spend(bars)
    line = capsys.readouterr().out
    assert line == ("llm cost: $0.5000 for 7 summary calls, 900 prompt + 70 completion tokens\n")
    unpriced = ProgressBars()
    unpriced(event())
    print_spend(unpriced)  # nothing metered: nothing printed
    assert capsys.readouterr().out == ""


# -- flags ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--max-cost-usd", "1"], "needs the model's prices"),
        (["--price-prompt", "1"], "go together"),
        (["--price-prompt", "-1", "--price-completion", "1"], "expected a number >= 0"),
        (["--max-cost-usd", "0", "--price-prompt", "1", "--price-completion", "1"], "> 0"),
        (["--max-summary-tokens", "0"], "expected an integer >= 1"),
    ],
)
def test_budget_flag_mistakes_are_usage_errors(
    tmp_path: Path, flags: list[str], fragment: str
) -> None:
    proc = raptor("build", str(CORPUS), "--out", str(tmp_path / "t"), "--dry-run", *flags)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_dry_run_prices_the_projection_and_warns_over_the_cap(tmp_path: Path) -> None:
    prices = ["--price-prompt", "150", "--price-completion", "600"]
    proc = raptor("build", str(CORPUS), "--out", str(tmp_path / "t"), "--dry-run", *prices)
    assert proc.returncode == 0, proc.stderr
    assert "projected llm cost: $" in proc.stdout
    assert "exceeds the budget" not in proc.stderr
    capped = raptor(
        "build", str(CORPUS), "--out", str(tmp_path / "t"), "--dry-run", *prices,
        "--max-cost-usd", "0.0001",
    )  # fmt: skip
    assert capped.returncode == 0, capped.stderr
    assert "exceeds the budget" in capped.stderr
