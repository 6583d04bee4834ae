"""``python -m plait``: the same as the ``plait`` command."""

import sys

from plait.cli.__main__ import SUBCOMMANDS, main

# ``plait analyze`` reads the flight-recorder dumps (docs/debugging.md). Its entry belongs in
# SUBCOMMANDS itself (plait/cli/__main__.py), where the ``plait`` console script finds it too;
# until it is there, ``python -m plait analyze`` gets it from here.
SUBCOMMANDS.setdefault(
    "analyze",
    (
        "plait.diagnostics.analyze",
        "say what went wrong first, from the flight-recorder dumps of every rank",
    ),
)

sys.exit(main())
