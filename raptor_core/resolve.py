"""Re-create a component from the description recorded in a tree's params.

Only classes inside ``raptor_core`` are re-created: a tree file never makes us import
arbitrary code (the same reason trees are never pickled).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from raptor_core.exceptions import InvalidParameterError

__all__ = ["from_description"]


def from_description(description: Mapping[str, Any]) -> Any:
    """Instantiate the ``raptor_core`` class named in ``description["class"]`` with its recorded params.

    Raises:
        InvalidParameterError: the class is outside raptor_core or cannot be re-created;
            pass the component explicitly instead.
    """
    path = str(description.get("class", ""))
    module_name, _, name = path.rpartition(".")
    if not module_name.startswith("raptor_core.") or not name:
        msg = f"cannot re-create {path or 'an unnamed component'} from a tree file: pass it explicitly"
        raise InvalidParameterError(msg)
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        msg = f"cannot import {path} recorded in the tree: {exc}"
        raise InvalidParameterError(msg) from exc
    accepted = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in description.items() if k != "class" and k in accepted}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        msg = f"cannot re-create {path} from {kwargs}: {exc}; pass it explicitly"
        raise InvalidParameterError(msg) from exc
