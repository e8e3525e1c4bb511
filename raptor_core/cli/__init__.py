"""The ``raptor`` command line: build, query and inspect trees.

This is an application entry point, so unlike the library modules it prints.  One module
per command (:mod:`~raptor_core.cli.build`, :mod:`~raptor_core.cli.query`,
:mod:`~raptor_core.cli.inspect`), each with an ``add_parser(subparsers)`` that registers it;
:mod:`~raptor_core.cli.app` holds the parser, :func:`main` and the mapping of errors to exit
statuses; :mod:`~raptor_core.cli.readers` reads the input files.
"""

from __future__ import annotations

from raptor_core.cli._common import EXIT_FAILURE, EXIT_USAGE
from raptor_core.cli.app import main
from raptor_core.cli.readers import read_documents

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "main", "read_documents"]
