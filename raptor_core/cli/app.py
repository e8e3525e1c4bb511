"""The ``raptor`` parser, :func:`main`, and the mapping of errors to one line and a status."""

from __future__ import annotations

import argparse
import errno
import os
import sqlite3
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NoReturn

from raptor_core.cli import build, export_onnx, inspect, query, update
from raptor_core.cli._common import (
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    one_line,
    os_advice,
    path_text,
)
from raptor_core.exceptions import (
    InvalidInputError,
    InvalidParameterError,
    LLMAuthenticationError,
    RaptorError,
    TreeFormatError,
    TreeSaveError,
)

__all__ = ["main", "make_parser"]


class _ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where to find help, no usage block."""

    def error(self, message: str) -> NoReturn:
        """Print ``prog: error: message`` on one line and exit with status 2."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {one_line(message)} (see {self.prog} -h)\n")


def make_parser() -> argparse.ArgumentParser:
    """The ``raptor`` parser: one subcommand per module, each registered by its ``add_parser``."""
    parser = _ArgumentParser(prog="raptor", description="Build and query RAPTOR trees.")
    sub = parser.add_subparsers(dest="command", required=True)
    build.add_parser(sub)
    query.add_parser(sub)
    inspect.add_parser(sub)
    update.add_parsers(sub)
    export_onnx.add_parser(sub)

    from raptor_core.evaluation.cli import add_eval_parser  # light: argparse only

    add_eval_parser(sub)
    return parser


# -- errors --------------------------------------------------------------------------------------
#: Errors about the path the user typed: a usage error (2), not a failure of the work (1).
_USAGE_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR})
#: Fixed by changing the command, its inputs or its settings (a missing or rejected API key, an
#: unknown model name: retrying cannot help), as opposed to a failure of the work itself.
_USAGE_ERRORS = (InvalidParameterError, InvalidInputError, TreeFormatError, LLMAuthenticationError)


def _describe_os_error(exc: OSError) -> str:
    where = exc.filename if exc.filename is not None else None
    advice = os_advice(exc)
    if where is None:
        return advice
    shown = where if isinstance(where, str) else os.fsdecode(where)
    return f"{path_text(Path(shown))}: {advice}"


def report(command: str, message: object, *, kind: str | None = "error") -> None:
    """One line on stderr: ``raptor CMD: error: ...`` (control characters escaped)."""
    prefix = f"{command}: {kind}: " if kind else f"{command}: "
    with suppress(OSError, ValueError):  # stderr itself is gone: nothing more can be said
        print(prefix + one_line(message), file=sys.stderr, flush=True)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _harden_stdio() -> None:
    """Never fail to *encode* output: unencodable characters are written as escapes."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if callable(reconfigure):
            with suppress(OSError, ValueError):
                reconfigure(errors="backslashreplace")


@contextmanager
def _one_line_warnings(command: str) -> Iterator[None]:
    """Show warnings (a tree from another version, another model) as one line each."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: Any = None,
        line: str | None = None,
    ) -> None:
        report(command, message, kind="warning")

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


@contextmanager
def _no_model_loading_bars() -> Iterator[None]:
    """Turn transformers' own progress bars off for the command, however it was imported.

    ``HF_HUB_DISABLE_PROGRESS_BARS`` (set in :func:`main`) is read when transformers is
    imported.  In a process that imported it before calling ``main()`` (a script, a
    notebook) the variable comes too late, and every model load would draw a "Loading
    weights" bar on stderr.  The setting is put back afterwards.
    """
    bars = sys.modules.get("transformers.utils.logging")
    quiet = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower()
    enabled = getattr(bars, "is_progress_bar_enabled", None)
    if quiet not in {"1", "true", "yes", "on"} or not callable(enabled) or not enabled():
        yield
        return
    bars.disable_progress_bar()  # type: ignore[union-attr]
    try:
        yield
    finally:
        bars.enable_progress_bar()  # type: ignore[union-attr]


def _run(args: argparse.Namespace, command: str) -> int:
    """Run the command; map user mistakes and environment faults to one line and a status."""
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe surfaces here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # The reader went away (`raptor query ... | head -1`): stop quietly, as Python's
        # documentation recommends for SIGPIPE.
        _silence_stdout()
        return EXIT_FAILURE
    except KeyboardInterrupt:
        report(command, "interrupted", kind=None)
        return EXIT_INTERRUPTED
    except _USAGE_ERRORS as exc:
        report(command, exc)
        return EXIT_USAGE
    except TreeSaveError as exc:  # an OSError too: the same status as the error it wraps
        report(command, exc)
        return EXIT_USAGE if exc.errno in _USAGE_ERRNOS else EXIT_FAILURE
    except RaptorError as exc:  # a model, a service or a missing package failed
        report(command, exc)
        return EXIT_FAILURE
    except OSError as exc:
        report(command, _describe_os_error(exc))
        return EXIT_USAGE if exc.errno in _USAGE_ERRNOS else EXIT_FAILURE
    except sqlite3.Error as exc:  # the build cache: a full or read-only disk under SQLite
        report(command, f"the build cache failed: {exc}")
        return EXIT_FAILURE
    except UnicodeError as exc:
        report(command, f"text that is not valid Unicode: {exc}")
        return EXIT_FAILURE
    except MemoryError:
        report(command, "out of memory: use smaller inputs or a machine with more memory")
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``raptor`` command.

    Exit status: 0 on success; 2 (``EXIT_USAGE``) when the command line, its inputs or
    its settings are wrong (a bad flag, a missing path, a document that is not text, a tree
    that needs ``--embedder``, a missing or rejected API key, an unknown model); 1
    (``EXIT_FAILURE``) when the work failed (no space, a read-only output, a model or
    service error such as a timeout, a closed output pipe); 130 when interrupted.  Errors
    are one line on stderr, with control characters escaped, never a traceback.
    """
    # The packaged model loads from disk; never let a missing network stall the CLI.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # transformers draws a "Loading weights" bar on every model load; the CLI has its own.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _harden_stdio()
    try:
        args = make_parser().parse_args(argv)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `raptor -h | head -1`
        _silence_stdout()
        return EXIT_FAILURE
    except SystemExit:  # --help printed, or a usage error reported: flush while we can
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
        raise
    command = f"raptor {args.command}"
    with _one_line_warnings(command), _no_model_loading_bars():
        return _run(args, command)
