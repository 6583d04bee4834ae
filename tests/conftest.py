"""Shared fixtures: make ``tests/`` importable for the helpers module."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
