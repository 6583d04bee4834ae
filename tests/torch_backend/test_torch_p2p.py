"""Point to point of the "plait" process group in one process: receive from any source first.

Each rank's :class:`~plait.torch.ProcessGroupPlait` wraps a communicator of
plait's in-process transport (``plait.testing.memory_communicators``), and the
tests call the group's methods as torch does (``send``, ``recv``,
``recv_anysource``): no ranks to start, no default group. Sends run on lanes
and receives are posted at once, so one thread can play every rank.
Multi-process checks (through ``dist.recv`` on the default group and on a
sub-group) are in ``torch_rank_check.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)

import plait  # noqa: E402
from plait.testing import memory_communicators  # noqa: E402
from plait.torch import PlaitWork, ProcessGroupPlait  # noqa: E402

#: The communicators' deadline: every wait below ends by then at the latest.
TIMEOUT = 10.0


def groups(size: int, timeout: float = TIMEOUT) -> Iterator[list[ProcessGroupPlait]]:
    pgs = [ProcessGroupPlait(c) for c in memory_communicators(size, timeout=timeout)]
    try:
        yield pgs
    finally:
        for pg in pgs:
            pg.shutdown()


@pytest.fixture
def three() -> Iterator[list[ProcessGroupPlait]]:
    yield from groups(3)


def send(pg: ProcessGroupPlait, value: float, dst: int, tag: int = 0) -> PlaitWork:
    return pg.send([torch.full((4,), value)], dst, tag)


def test_any_source_names_each_sender(three: list[ProcessGroupPlait]) -> None:
    """Two senders, two any-source receives: each gets one message and names its sender."""
    got = [torch.full((4,), -1.0) for _ in range(2)]
    works = [three[0].recv_anysource([t], 0) for t in got]
    sends = [send(three[1], 1.0, 0), send(three[2], 2.0, 0)]
    for w in works + sends:
        assert w.wait() is True
    sources = [w._source_rank() for w in works]
    assert sorted(sources) == [1, 2]
    for t, source in zip(got, sources, strict=True):
        assert torch.equal(t, torch.full((4,), float(source)))  # the sender's own message


def test_source_rank_is_minus_one_until_done(three: list[ProcessGroupPlait]) -> None:
    """As gloo's: -1 until the message is in; the future completes with no wait() (DDP's way)."""
    t = torch.zeros(4)
    work = three[0].recv_anysource([t], 5)
    assert work.source_rank() == -1
    assert not work.is_completed()
    future = work.get_future()
    send(three[2], 7.0, 0, tag=5).wait()
    assert future.wait()[0] is t
    assert work.is_completed()
    assert work.source_rank() == 2
    assert torch.equal(t, torch.full((4,), 7.0))


@pytest.mark.parametrize(
    ("order", "want"),
    [
        (["any", 1], [10.0, 11.0]),
        ([1, "any"], [10.0, 11.0]),
        (["any", 1, "any", 1], [10.0, 11.0, 12.0, 13.0]),
    ],
    ids=["any-first", "specific-first", "interleaved"],
)
def test_receives_match_in_the_order_they_are_called(
    three: list[ProcessGroupPlait], order: list[object], want: list[float]
) -> None:
    """MPI's order: a message goes to the earliest receive called that accepts it.

    Rank 1 sends 10, 11, ... on one tag; rank 0's receives, from rank 1 or
    from any rank, take them in the order rank 0 called them, whichever lane
    waits for each.
    """
    got = [torch.zeros(4) for _ in order]
    works = [
        three[0].recv_anysource([t], 3) if src == "any" else three[0].recv([t], 1, 3)
        for t, src in zip(got, order, strict=True)
    ]
    sends = [send(three[1], v, 0, tag=3) for v in want]
    for w in works + sends:
        w.wait()
    assert [float(t[0]) for t in got] == want
    assert [w._source_rank() for w in works] == [1] * len(order)


def test_tags_are_apart(three: list[ProcessGroupPlait]) -> None:
    """An any-source receive takes only its own tag's messages, whatever comes first."""
    a, b = torch.zeros(4), torch.zeros(4)
    on_2 = three[0].recv_anysource([a], 2)
    send(three[1], 1.0, 0, tag=1).wait()  # another tag: stays for its own receive
    send(three[2], 2.0, 0, tag=2).wait()
    on_2.wait()
    assert (float(a[0]), on_2._source_rank()) == (2.0, 2)
    on_1 = three[0].recv_anysource([b], 1)
    on_1.wait()
    assert (float(b[0]), on_1._source_rank()) == (1.0, 1)


def test_a_tag_per_message_leaves_no_thread_behind(three: list[ProcessGroupPlait]) -> None:
    """A new tag for every message (a step number): each (direction, peer, tag) kept a thread
    until the group was destroyed, 2 x 400 here; now a lane ends once it has run empty."""
    before = threading.active_count()
    got = torch.zeros(4)
    for step in range(400):
        recv = three[1].recv([got], 0, step)
        send(three[0], float(step), 1, tag=step).wait()
        recv.wait()
        assert float(got[0]) == step
    assert threading.active_count() - before <= 6  # a sender's and a receiver's, and idle ones


def test_a_timed_out_receive_is_withdrawn() -> None:
    """At the deadline the receive is withdrawn: a later message goes to the next receive."""
    for pgs in groups(2, timeout=0.3):
        stale = torch.full((4,), -1.0)
        late = pgs[0].recv_anysource([stale], 0)
        with pytest.raises(plait.CommTimeout, match=r"Timed out.*any rank \(tag 0\)"):
            late.wait()
        assert late.source_rank() == -1
        fresh = torch.zeros(4)
        work = pgs[0].recv_anysource([fresh], 0)
        send(pgs[1], 3.0, 0).wait()
        work.wait()
        assert work.source_rank() == 1
        assert torch.equal(fresh, torch.full((4,), 3.0))
        assert torch.equal(stale, torch.full((4,), -1.0))  # never written


def test_a_message_of_another_size_fails_the_receive(three: list[ProcessGroupPlait]) -> None:
    work = three[0].recv_anysource([torch.zeros(3)], 0)
    send(three[1], 1.0, 0)
    with pytest.raises(plait.MismatchError):
        work.wait()
    assert work.source_rank() == -1
    assert not work.is_success()


def test_any_source_after_shutdown_is_refused() -> None:
    for pgs in groups(2):
        pgs[0].shutdown()
        with pytest.raises(plait.ClosedError, match="shut down"):
            pgs[0].recv_anysource([torch.zeros(4)], 0)
