"""The transport conformance suite over every transport: memory (eager and lockstep) and TCP."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import pytest
from tcp_helpers import no_leaks, tcp_transports  # noqa: F401 (fixture)

from plait.transport import conformance
from plait.transport.base import Transport
from plait.transport.conformance import BUFFERED_CHECKS, CHECKS, Factory
from plait.transport.memory import MemoryFabric


def _memory(size: int, lockstep: bool = False) -> Sequence[Transport]:
    # cast: MemoryTransport's cancel/wait_any are typed for its own handle class.
    return cast(Sequence[Transport], MemoryFabric(size, lockstep=lockstep).endpoints)


FACTORIES: dict[str, Factory] = {
    "memory": _memory,
    "lockstep": lambda size: _memory(size, lockstep=True),
    "tcp": tcp_transports,
    "tcp-3-streams": lambda size: tcp_transports(size, streams=3),
}

pytestmark = pytest.mark.usefixtures("no_leaks")


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
@pytest.mark.parametrize(
    "transport",
    # the quick loop (-m "not slow") checks plain TCP here; shared memory in
    # test_shm_conformance.py, the endpoint over a toy link in test_endpoint.py, and the memory
    # transport under every real-data test of tests/integration
    [t if t == "tcp" else pytest.param(t, marks=pytest.mark.slow) for t in FACTORIES],
)
def test_conformance(transport: str, check: Callable[[Factory], None]) -> None:
    if transport == "lockstep" and check in BUFFERED_CHECKS:
        pytest.skip("lockstep mode has zero buffering: a send waits for its receive by design")
    check(FACTORIES[transport])


def test_every_check_is_listed() -> None:
    listed = {f.__name__ for f in CHECKS}
    defined = {n for n in dir(conformance) if n.startswith("check_")}
    assert listed == defined
    assert set(conformance.__all__) >= defined
