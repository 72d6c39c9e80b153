"""``python -m qcompile``: the command line (:mod:`qcompile.cli`)."""

import sys

from .cli import main

sys.exit(main())
