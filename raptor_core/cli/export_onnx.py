"""``raptor export-onnx``: export the embedding model for fast query embedding."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from typing import Any

from raptor_core.cli._common import safe

__all__ = ["add_parser", "run_export_onnx"]


def run_export_onnx(args: argparse.Namespace) -> int:
    """Run ``raptor export-onnx`` with parsed ``args``; returns the exit status."""
    from raptor_core.backends.onnx import default_onnx_dir, export_onnx

    # torch's exporter logs a warning for each optional operator library it does not find
    # (torchvision's detection operators): noise on the terminal of someone exporting a
    # text model.  Errors still show.  Set after torch is imported: importing it resets the
    # levels of its loggers.
    if importlib.util.find_spec("torch") is not None:
        import torch.onnx  # noqa: F401

        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out = export_onnx(args.out or default_onnx_dir(), args.model)
    print(safe(f"exported {args.model} to {out}"))
    if args.out is None:
        print("`raptor query` now embeds queries for trees of this model through ONNX Runtime")
    return 0


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``export-onnx`` on the ``raptor`` command's subparsers."""
    parser = sub.add_parser(
        "export-onnx",
        help="export the embedding model to ONNX: `raptor query` starts without torch",
        description="Export a sentence-transformers model (default: the packaged "
        "all-MiniLM-L6-v2) to ONNX, once.  `raptor query` then embeds queries for trees "
        "built with the default model through ONNX Runtime: the same vectors, a faster start. "
        "Needs torch 2.6 or later and `pip install 'raptor-retriever[onnx]'`.",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="directory to write (default: $RAPTOR_ONNX_DIR, else "
        "~/.cache/raptor-retriever/onnx/all-MiniLM-L6-v2, where `raptor query` looks)",
    )
    parser.add_argument(
        "--model",
        default="all-MiniLM-L6-v2",
        help="sentence-transformers model name or directory (all-MiniLM-L6-v2)",
    )
    parser.set_defaults(func=run_export_onnx)
    return parser
