"""Shared set-up: make ``tests/`` importable for the helpers module; hermetic settings.

The tests must not depend on this machine's tuning: a profile written by
``plait tune`` (``~/.config/plait/profile.json``) or a PLAIT_ALGO in the
environment would change what ``algorithm="auto"`` picks. Both are cleared
for the whole session (ranks started by the tests inherit that); tests that
want them set their own.
"""

import os
import sys
from pathlib import Path

from plait.selection import select as _select

sys.path.insert(0, str(Path(__file__).parent))

os.environ["PLAIT_PROFILE"] = str(Path(__file__).parent / "no-such-profile.json")
os.environ.pop("PLAIT_ALGO", None)
os.environ["PLAIT_RULES"] = os.devnull  # an empty rules file, not ~/.config/plait/rules.toml


# In-process ranks choose as on a host with a core for every rank, whatever this machine has
# (the oversubscribed rules would otherwise depend on it); tests that want fewer cores patch
# select._cores themselves. Ranks in child processes see the real count.
_select._cores = lambda: 1024
