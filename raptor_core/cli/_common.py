"""What every ``raptor`` command shares: exit statuses and terminal-safe text.

A document, a tree file or an error message must never drive the terminal, so everything
printed from them goes through :func:`safe` (control characters become escapes).
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any

from raptor_core.exceptions import InvalidInputError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "TREE_FILE",
    "check_unicode",
    "load_tree",
    "one_line",
    "os_advice",
    "path_text",
    "safe",
    "safe_json",
]

#: Exit status when the command line or its inputs are wrong (fix the command and rerun).
EXIT_USAGE = 2
#: Exit status when the work failed: the disk, the output, a model or service, a closed pipe.
EXIT_FAILURE = 1
EXIT_INTERRUPTED = 130

#: The file a tree directory always holds (see raptor_core.tree).
TREE_FILE = "tree.json"

#: What an OS error means for the user, in words, and what to do.
_OS_ADVICE = {
    errno.ENOSPC: "no space left on the device: free some space or write elsewhere",
    errno.EDQUOT: "disk quota exceeded: free some space or write elsewhere",
    errno.EROFS: "read-only file system: write somewhere else",
    errno.EACCES: "permission denied: check the permissions or use another path",
    errno.EPERM: "operation not permitted: check the permissions or use another path",
    errno.ENOENT: "no such file or directory: check the path",
    errno.ENOTDIR: "a part of the path is not a directory: check the path",
    errno.EISDIR: "is a directory, not a file: check the path",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n) and retry",
    errno.EIO: "input/output error: the disk or the network file system failed",
}


def os_advice(exc: OSError) -> str:
    """What ``exc`` means and what to do, without the file's name."""
    return _OS_ADVICE.get(exc.errno or 0) or (exc.strerror or type(exc).__name__)


# C0 controls except tab and newline, DEL and the C1 controls (U+009B is a one-character CSI on
# some terminals).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# What json.dumps leaves unescaped of the above: DEL and C1.
_JSON_CONTROL = re.compile(r"[\x7f-\x9f]")


def safe(text: object) -> str:
    r"""``text`` with control characters shown as escapes such as ``\x1b`` (newline, tab kept)."""
    value = str(text).replace("\r\n", "\n")
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", value)


def safe_json(document: Any, **kwargs: Any) -> str:
    """JSON text with every control character escaped (``json`` leaves DEL and C1 raw)."""
    text = json.dumps(document, ensure_ascii=False, **kwargs)
    return _JSON_CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def one_line(text: object) -> str:
    """``text`` made safe and folded onto one line (for error and report lines)."""
    return " ".join(safe(text).split())


def check_unicode(text: str, what: str) -> str:
    """``text``, or InvalidInputError if it holds lone surrogates (bytes that were not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        msg = (
            f"{what} holds {text[exc.start : exc.end]!a}, which is not Unicode text "
            "(bytes that are not UTF-8, or a lone surrogate): check its encoding"
        )
        raise InvalidInputError(msg) from None
    return text


def path_text(path: Path) -> str:
    """``path`` as text that is valid Unicode (undecodable bytes in a name become escapes)."""
    name = str(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(path).decode("utf-8", "backslashreplace")
    return name


def load_tree(directory: str) -> Any:
    """The tree saved in ``directory`` (memory-mapped embeddings)."""
    from raptor_core.tree import Tree

    return Tree.load(directory, mmap=True)
