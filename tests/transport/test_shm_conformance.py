"""The shared conformance suite, run on the shared-memory transport (threads as ranks)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from plait.rendezvous.store import MemoryStore
from plait.transport import conformance
from plait.transport.shm import ShmTransport

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")

#: Default geometry, and tiny slots so that every message takes many chunks.
GEOMETRIES = {"default": {}, "small-slots": {"slot_bytes": 8192, "slots": 3}}


@pytest.fixture(autouse=True)
def no_leftover_segments(own_segments: list[str]) -> None:
    """Every test removes the segments its own transports created (see conftest.py)."""


def factory(**kwargs: Any) -> Callable[[int], Sequence[ShmTransport]]:
    store = MemoryStore(timeout=30)  # one store for every group the check makes

    def make(size: int) -> Sequence[ShmTransport]:
        return conformance.build_in_threads(
            size, lambda rank: ShmTransport(rank, size, store, timeout=30, **kwargs)
        )

    return make


@pytest.mark.parametrize(
    "geometry",
    # the quick loop (-m "not slow") checks the default geometry
    [g if g == "default" else pytest.param(g, marks=pytest.mark.slow) for g in GEOMETRIES],
)
@pytest.mark.parametrize("check", conformance.CHECKS, ids=lambda f: f.__name__)
def test_conformance(check: Callable[[conformance.Factory], None], geometry: str) -> None:
    check(factory(**GEOMETRIES[geometry]))
