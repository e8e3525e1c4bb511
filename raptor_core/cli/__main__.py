"""``python -m raptor_core.cli``: the ``raptor`` command."""

from __future__ import annotations

from raptor_core.cli.app import main

raise SystemExit(main())
