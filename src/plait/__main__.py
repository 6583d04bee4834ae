"""``python -m plait``: the same as the ``plait`` command."""

import sys

from plait.cli.__main__ import main

sys.exit(main())
