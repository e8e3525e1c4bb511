"""Import optional dependencies where they are used, with an actionable error."""

from __future__ import annotations

import importlib
from types import ModuleType

from raptor_core.exceptions import MissingDependencyError

__all__ = ["is_instance_of", "require"]


def require(module: str, *, extra: str | None = None, package: str | None = None) -> ModuleType:
    """Import ``module`` or raise :class:`MissingDependencyError` naming the install command.

    Args:
        module: dotted module name to import.
        extra: the ``raptor-retriever`` extra that provides it, if any.
        package: the PyPI distribution name, when it differs from the module name.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if extra is not None:
            how = f"pip install 'raptor-retriever[{extra}]'"
        else:
            how = f"pip install {package or module.split('.')[0]}"
        msg = f"{module!r} is required for this feature but is not installed: run `{how}`."
        raise MissingDependencyError(msg) from exc


def is_instance_of(obj: object, module: str, name: str) -> bool:
    """Whether ``obj`` is an instance of class ``name`` from ``module`` (or a subclass of it).

    Decided from the class's own names, so the adapters recognise an optional integration
    (``langchain_chroma.Chroma``, LlamaIndex's FAISS store, ...) without importing it for
    users who do not have it.

    Examples:
        >>> from collections import OrderedDict
        >>> is_instance_of(OrderedDict(), "collections", "OrderedDict")
        True
        >>> is_instance_of({}, "collections", "OrderedDict")
        False
    """
    return any(
        cls.__name__ == name and cls.__module__.startswith(module) for cls in type(obj).__mro__
    )
