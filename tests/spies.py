"""Spies on the call runner: which of its frames ran which calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from plait._runner import CallRunner


def runs_of(
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    label: Callable[[Any], str] = lambda req: req.spec.collective,
) -> list[str]:
    """``label(req)`` of every request ``CallRunner.<method>`` runs from now until the
    test ends (in the order they run, over every rank's thread)."""
    taken: list[str] = []
    whole = getattr(CallRunner, method)

    def spy(self: CallRunner, req: Any, *args: Any, **kwargs: Any) -> Any:
        taken.append(label(req))
        return whole(self, req, *args, **kwargs)

    monkeypatch.setattr(CallRunner, method, spy)
    return taken
