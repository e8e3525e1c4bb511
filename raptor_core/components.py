"""What loading a tree may create by itself, and the checks on what the caller passes instead.

A saved tree is data, like a ``safetensors`` file: whoever hands you one controls every byte of
it, and its checksum (unkeyed) only detects accidents.  So ``tree.params["embedder"]`` (written
by :func:`raptor_core.build.builder.describe`) *describes* how the tree was built; it never
names code to import.  A load re-creates an embedder on its own only from this closed
allowlist, with validated arguments:

* :class:`~raptor_core.backends.sentence_transformers.SentenceTransformerEmbedder` for the
  packaged default ``all-MiniLM-L6-v2`` or a Hugging Face hub id (``name`` or
  ``namespace/name``, checked against a strict pattern).  The only arguments taken from the
  file are ``normalize``, ``batch_size`` and the ``query_prompt``/``document_prompt`` strings
  (bounded); ``device`` is ignored, and ``trust_remote_code`` is refused unless false.  A
  name that also exists as a path relative to the current directory is refused (and the
  embedder re-checks when it loads the model), because sentence-transformers would load that
  directory first, and a model directory names the classes it is made of.  A hub model that
  is not cached is downloaded when the machine is online (the ``raptor`` command runs
  offline unless ``HF_HUB_OFFLINE=0``).
* :class:`~raptor_core.testing.FakeEmbedder` with a validated ``dim`` (tests and examples).

Everything else (a local model path, OpenAI or any other remote endpoint, LangChain and
LlamaIndex wrappers, your own classes) must be passed by the caller: the error says which
argument (``embedder=``, ``embeddings=``, ``embed_model=`` or ``--embedder``).  URLs, API
keys, headers, devices, file and cache paths are never taken from a file.

When the caller passes the embedder, :func:`check_embedder` compares it with the record:
a dimension that differs from the tree's vectors is an error (the results would be
meaningless); a different model name with no known dimension conflict is an
:class:`EmbedderMismatchWarning`, because the caller chose the model explicitly and a
renamed copy of the same model (a local path versus a hub id) is legitimate.
"""

from __future__ import annotations

import inspect
import logging
import re
import shlex
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raptor_core.exceptions import InvalidParameterError, TreeFormatError

if TYPE_CHECKING:
    from raptor_core.tree import Tree
    from raptor_core.types import Embedder

__all__ = [
    "ALLOWED_EMBEDDERS",
    "EmbedderMismatchWarning",
    "check_embedder",
    "embedder_for_tree",
    "recreate_embedder",
]

logger = logging.getLogger(__name__)

_ST_CLASS = "raptor_core.backends.sentence_transformers.SentenceTransformerEmbedder"
_FAKE_CLASS = "raptor_core.testing.FakeEmbedder"

#: The only embedder classes a load creates by itself (recorded ``class`` values).
ALLOWED_EMBEDDERS = frozenset({_ST_CLASS, _FAKE_CLASS})

# A hub repo id: ``name`` or ``namespace/name``; letters, digits, ``-``, ``_``, ``.``; no
# leading/trailing ``-``/``.``, no ``--``/``..`` (the hub's own rules), at most 96 per part.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"{_HUB_PART}(?:/{_HUB_PART})?")
# What an error message may suggest literally in a command (anything else becomes a placeholder).
_SAFE_LITERAL = re.compile(r"[A-Za-z0-9./][A-Za-z0-9._:/@+-]{0,199}")
_MAX_PROMPT_CHARS = 1_000
_MAX_BATCH_SIZE = 4_096
_MAX_FAKE_DIM = 65_536
#: Sentence-transformers before 6.0 imports any installed class a model's ``modules.json``
#: names, even with ``trust_remote_code=False``; a hub id from a file needs 6.0 or later.
_MIN_ST_FOR_HUB_IDS = (6, 0)


class EmbedderMismatchWarning(UserWarning):
    """The embedder passed for a tree names another model than the one the tree records."""


# -- messages --------------------------------------------------------------------------------------
def _show(value: object, limit: int = 120) -> str:
    """``value`` for a message: repr-quoted (control characters escaped) and bounded."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 4] + "...'"


def _literal(value: object) -> str | None:
    """``value`` when it is safe to print inside a suggested command, else None."""
    if isinstance(value, str) and _SAFE_LITERAL.fullmatch(value):
        return value
    return None


def _recorded_model(record: Mapping[str, Any]) -> str | None:
    for key in ("model_name_or_path", "model", "model_name"):
        value = record.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _is_cli(pass_as: str) -> bool:
    return pass_as.startswith("--")


def _how_to_pass(record: Mapping[str, Any] | None, pass_as: str) -> str:
    """The sentence that tells the caller what to pass instead."""
    cls = record.get("class") if record is not None else None
    model = _recorded_model(record) if record is not None else None
    shown = _literal(model)
    if _is_cli(pass_as):
        if cls == _ST_CLASS:
            target = shlex.quote(shown) if shown else "PATH_OR_NAME"
            return f"pass {pass_as} {target} (the sentence-transformers model it was built with)"
        if cls == "raptor_core.backends.openai.OpenAIEmbedder":
            target = shlex.quote(f"openai:{shown}") if shown else "openai:MODEL"
            return (
                f"pass {pass_as} {target}, with --embed-base-url URL if it was built "
                "against a server other than OpenAI's"
            )
        return (
            f"pass {pass_as} with the model it was built with: a sentence-transformers name or "
            f"path ({pass_as} NAME_OR_PATH) or an OpenAI-compatible model ({pass_as} "
            "openai:MODEL with --embed-base-url URL); other models only from Python"
        )
    if cls == _ST_CLASS:
        target = repr(shown) if shown else "'<model name or path>'"
        return f"pass {pass_as}=SentenceTransformerEmbedder({target})"
    if cls == "raptor_core.backends.openai.OpenAIEmbedder":
        target = repr(shown) if shown else "'<model>'"
        return (
            f"pass {pass_as}=OpenAIEmbedder({target}, base_url=...) with the server it was "
            "built against"
        )
    extra = " (or set Settings.embed_model)" if pass_as == "embed_model" else ""
    return f"pass {pass_as}= (the same model the tree was built with){extra}"


def _refuse(record: Mapping[str, Any] | None, pass_as: str, why: str) -> InvalidParameterError:
    return InvalidParameterError(f"{why}; {_how_to_pass(record, pass_as)}")


# -- re-creating the allowlisted embedders ---------------------------------------------------------
def _st_version() -> tuple[int, ...] | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        raw = version("sentence-transformers")
    except PackageNotFoundError:
        return None
    parts = []
    for piece in raw.split(".")[:2]:
        digits = re.match(r"\d+", piece)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def _check_model_name(name: object, record: Mapping[str, Any], pass_as: str) -> str:
    """The recorded model name, if a load may use it on its own (see the module docstring)."""
    from raptor_core.backends.sentence_transformers import DEFAULT_MODEL

    if not isinstance(name, str) or not name:
        raise _refuse(record, pass_as, "the tree records no sentence-transformers model name")
    if not _HUB_ID.fullmatch(name) or ".." in name or "--" in name:
        raise _refuse(
            record,
            pass_as,
            f"the tree was embedded with the local model {_show(name)}: a load never opens a "
            "path named by a file",
        )
    if Path(name).exists():
        raise _refuse(
            record,
            pass_as,
            f"the tree names the model {_show(name)} and {_show(str(Path.cwd() / name))} "
            "exists: sentence-transformers would load that local directory instead of the "
            "hub model, so it is not loaded on the file's word",
        )
    if name.removeprefix("sentence-transformers/") != DEFAULT_MODEL:
        installed = _st_version()
        if installed is not None and installed < _MIN_ST_FOR_HUB_IDS:
            raise _refuse(
                record,
                pass_as,
                f"the tree names the hub model {_show(name)}, and sentence-transformers "
                f"{'.'.join(map(str, installed))} would import any class that model's files "
                "name (upgrade to sentence-transformers>=6.0 to load it by itself)",
            )
    return name


def _st_from_record(record: Mapping[str, Any], pass_as: str) -> Embedder:
    from raptor_core.backends.sentence_transformers import SentenceTransformerEmbedder

    kwargs: dict[str, Any] = {}
    for key, value in record.items():
        if key in {"class", "model_name_or_path"}:
            continue
        if key == "device":
            # A device is this machine's business, never the file's: the default (the best
            # device available here) is used, so a tree built on a GPU loads on a CPU.
            if value is not None and not isinstance(value, str):
                raise _refuse(record, pass_as, f"the tree records an invalid device {_show(value)}")
        elif key == "trust_remote_code":
            if value is not False:
                raise _refuse(
                    record,
                    pass_as,
                    "the tree asks for trust_remote_code, which a load never grants "
                    "(pass the model yourself if you trust its code)",
                )
        elif key == "normalize":
            if not isinstance(value, bool):
                raise _refuse(record, pass_as, f"the tree records normalize={_show(value)}")
            kwargs[key] = value
        elif key == "batch_size":
            if value is None:
                continue  # chosen for this machine's device (a tree built on a GPU, say)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 1 <= value <= _MAX_BATCH_SIZE
            ):
                raise _refuse(record, pass_as, f"the tree records batch_size={_show(value)}")
            kwargs[key] = value
        elif key in {"query_prompt", "document_prompt"}:
            if value is not None and (
                not isinstance(value, str)
                or len(value) > _MAX_PROMPT_CHARS
                or any(ord(ch) < 32 and ch not in "\n\t" for ch in value)
            ):
                raise _refuse(record, pass_as, f"the tree records an unusable {key}")
            kwargs[key] = value
        else:
            raise _refuse(
                record,
                pass_as,
                f"the tree records the embedder argument {_show(key, 60)}, which a load never "
                "takes from a file",
            )
    name = _check_model_name(record.get("model_name_or_path"), record, pass_as)
    embedder = SentenceTransformerEmbedder(name, trust_remote_code=False, **kwargs)
    # Re-checked when the model loads (lazily): a directory created meanwhile is refused too.
    embedder._hub_only = True
    return embedder


def _fake_from_record(record: Mapping[str, Any], pass_as: str, dim: int | None) -> Embedder:
    from raptor_core.testing import FakeEmbedder

    for key, value in record.items():
        if key in {"class", "dim"}:
            continue
        # Older trees recorded FakeEmbedder's call counters; they are state, not parameters.
        if key in {"calls", "texts_embedded"} and isinstance(value, int):
            continue
        raise _refuse(
            record, pass_as, f"the tree records the FakeEmbedder argument {_show(key, 60)}"
        )
    value = record.get("dim", 64)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_FAKE_DIM:
        raise _refuse(record, pass_as, f"the tree records FakeEmbedder(dim={_show(value)})")
    if dim is not None and value != dim:
        msg = (
            f"the tree records FakeEmbedder(dim={value}) but its vectors have {dim} dimensions: "
            "the file was edited or damaged"
        )
        raise TreeFormatError(msg)
    return FakeEmbedder(dim=value)


def recreate_embedder(
    record: object, *, dim: int | None = None, pass_as: str = "embedder"
) -> Embedder:
    """Create the embedder a tree records, if it is on the closed allowlist.

    Args:
        record: ``tree.params.get("embedder")``: what the file says (not trusted).
        dim: the dimension of the tree's vectors, to cross-check the record (None: unknown
            or an empty tree).
        pass_as: how the caller passes an embedder instead (``"embedder"``,
            ``"embeddings"``, ``"embed_model"``, ``"--embedder"``); used in the messages.

    Returns:
        A new embedder (a sentence-transformers model is loaded on first use).

    Raises:
        InvalidParameterError: the record names anything outside the allowlist, a local
            path, or an argument a load never takes from a file; the message says what to
            pass instead.
        TreeFormatError: the record contradicts the tree's own vectors.
    """
    if not isinstance(record, Mapping):
        why = (
            "the tree does not record its embedder"
            if record is None
            else f"the tree's embedder record is not a description ({_show(record, 60)})"
        )
        raise _refuse(None, pass_as, why)
    cls = record.get("class")
    if cls == _ST_CLASS:
        return _st_from_record(record, pass_as)
    if cls == _FAKE_CLASS:
        return _fake_from_record(record, pass_as, dim)
    model = _recorded_model(record)
    built_with = _show(cls, 100) + (f" (model {_show(model, 80)})" if model else "")
    raise _refuse(
        record,
        pass_as,
        f"this tree was embedded with {built_with}, which a load never creates from a file "
        "(only local sentence-transformers models by name and the test fakes are)",
    )


# -- checking what the caller passes ---------------------------------------------------------------
def _declared_dim(embedder: object) -> int | None:
    """The embedder's dimension when it is known without loading a model or calling a service."""
    for name in ("dim", "dimensions"):
        # getattr_static: a ``dim`` property may load a model; only plain attributes count.
        value = inspect.getattr_static(embedder, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _normalised_model(name: str) -> str:
    from raptor_core.backends.sentence_transformers import DEFAULT_MODEL, packaged_model_path

    packaged = packaged_model_path()
    if packaged is not None and name.rstrip("/\\") == str(packaged):
        return DEFAULT_MODEL.lower()  # the packaged copy is the default model under its path
    short = name.strip().rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1]
    return short.lower()


def _model_of(embedder: object) -> str | None:
    from raptor_core.build.builder import describe

    try:
        return _recorded_model(describe(embedder))
    except Exception:
        return None


def check_embedder(tree: Tree, embedder: Embedder, *, pass_as: str = "embedder") -> None:
    """Check that the embedder a caller passed fits the tree it will search.

    Raises:
        InvalidParameterError: the embedder's known dimension differs from the tree's.

    Warns:
        EmbedderMismatchWarning: both name a model and the names differ (the dimension
            matches or is not known before the first query, which checks it again).
    """
    record = tree.params.get("embedder")
    record = record if isinstance(record, Mapping) else {}
    declared = _declared_dim(embedder)
    # A stored tree whose dimension its store cannot tell (0) is checked by the first query.
    if len(tree) and tree.dim and declared is not None and declared != tree.dim:
        recorded = _recorded_model(record)
        built = f" (it was built with {_show(recorded, 80)})" if recorded else ""
        msg = (
            f"the {pass_as} given embeds into {declared} dimensions but the tree's vectors "
            f"have {tree.dim}{built}: pass the model the tree was built with"
        )
        raise InvalidParameterError(msg)
    recorded = _recorded_model(record)
    given = _model_of(embedder)
    if recorded and given and _normalised_model(recorded) != _normalised_model(given):
        if recorded.lower() in {"unknown", "none"} or given.lower() in {"unknown", "none"}:
            return
        msg = (
            f"the tree was built with the model {_show(recorded, 80)} but the {pass_as} given "
            f"is {_show(given, 80)}: results are meaningful only with the same model"
        )
        logger.warning(msg)
        warnings.warn(msg, EmbedderMismatchWarning, stacklevel=3)


def embedder_for_tree(
    tree: Tree, embedder: Embedder | None = None, *, pass_as: str = "embedder"
) -> Embedder:
    """The embedder to query ``tree`` with: ``embedder`` (checked) or the allowlisted record.

    Args:
        tree: the tree (typically from :meth:`~raptor_core.tree.Tree.load`).
        embedder: what the caller passed, or None to re-create the recorded one.
        pass_as: the caller's name for the argument, used in messages.

    Raises:
        InvalidParameterError: see :func:`recreate_embedder` and :func:`check_embedder`.
        TreeFormatError: the record contradicts the tree's vectors.
    """
    if embedder is not None:
        check_embedder(tree, embedder, pass_as=pass_as)
        return embedder
    return recreate_embedder(
        tree.params.get("embedder"), dim=tree.dim if len(tree) else None, pass_as=pass_as
    )
