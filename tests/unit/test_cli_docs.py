"""docs/cli.md documents every ``raptor`` command and every one of its flags."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from raptor_core.cli.app import make_parser

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = make_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_command_and_flag_is_in_docs_cli_md() -> None:
    text = CLI_DOC.read_text(encoding="utf-8")
    missing = []
    for name, command in commands().items():
        if f"`raptor {name}" not in text:
            missing.append(f"the command `raptor {name}`")
        for action in command._actions:
            for flag in action.option_strings:
                if flag in {"-h", "--help"}:
                    continue
                # Written as `--flag`, `--flag VALUE` or `--flag=...`, in a table or the prose.
                if not re.search(r"`" + re.escape(flag) + r"[` =]", text):
                    missing.append(f"raptor {name} {flag}")
    assert not missing, (
        f"not documented in {CLI_DOC.name}: {', '.join(missing)}; add each to the flag table "
        "of its command there (`--flag VALUE` | default | meaning)"
    )
    assert len(commands()) >= 4
