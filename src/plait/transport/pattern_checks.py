"""The conformance checks of matching patterns (:class:`~plait.transport.base.Matching`).

Part of the suite of :mod:`plait.transport.conformance` (which lists them in
``CHECKS``): receives from any of several peers, tags under a mask, probes and
withdrawing, on every endpoint-based transport. Each ``check_*`` takes the
suite's ``make`` factory.
"""

from __future__ import annotations

import threading

import numpy as np

from plait.errors import PeerLostError
from plait.transport import harness
from plait.transport.base import Handle, Matching, Transport
from plait.transport.harness import WAIT, Factory, run_ranks, wait_all

__all__ = [
    "check_pattern_any_peer_takes_the_earliest",
    "check_pattern_keeps_mpi_order",
    "check_pattern_lost_peers",
    "check_probe",
    "check_withdraw",
]
#: A class of tags for the pattern checks: every tag whose bits above the low 8 are CLASS.
CLASS = 0x5A00
#: The mask of a pattern that takes any tag of CLASS.
ANY_IN_CLASS = ~0xFF


def _matching(t: Transport) -> Matching:
    assert isinstance(t, Matching), f"{type(t).__name__} does not match patterns"
    return t


def _done(t: Transport, h: Handle) -> None:
    """Wait for ``h`` and assert it succeeded."""
    harness.ok(t, [h])


def check_pattern_any_peer_takes_the_earliest(make: Factory) -> None:
    """A receive from any peer takes the earliest arrived message it matches, and no other.

    Rank 1's message arrives first (rank 2 sends only once rank 0 has seen it),
    and a message of rank 1 outside the tag class, sent before both, stays for
    the plain receive that wants it. The envelope names each message's peer,
    tag, length and check word.
    """
    ts = harness.made(make, 3)
    first_seen = threading.Event()
    try:

        def body(t: Transport) -> list[tuple[int, int, int, int]] | None:
            if t.rank == 1:
                hs = [
                    t.isend(0, 0x6000, harness.mv(harness.pattern(5, 60)), 1),
                    t.isend(0, CLASS | 1, harness.mv(harness.pattern(8, 1)), 1),
                ]
                harness.ok(t, hs)
                return None
            if t.rank == 2:
                assert first_seen.wait(WAIT), "rank 0 never saw rank 1's message"
                harness.ok(t, [t.isend(0, CLASS | 2, harness.mv(harness.pattern(8, 2)), 1)])
                return None
            m = _matching(t)
            _done(t, m.probe([1], CLASS | 1, -1))
            first_seen.set()
            _done(t, m.probe([2], CLASS, ANY_IN_CLASS))
            got = [np.zeros(8, np.uint8), np.zeros(8, np.uint8)]
            envelopes = []
            for i in range(2):
                h = m.irecv_match(None, CLASS, ANY_IN_CLASS, harness.mv(got[i]), 1)
                _done(t, h)
                envelopes.append(m.envelope(h))
                np.testing.assert_array_equal(got[i], harness.pattern(8, i + 1))
            other = np.zeros(5, np.uint8)
            _done(t, t.irecv(1, 0x6000, harness.mv(other), 1))
            np.testing.assert_array_equal(other, harness.pattern(5, 60))
            return envelopes

        envelopes = run_ranks(ts, body)[0]
        assert envelopes == [(1, CLASS | 1, 8, 1), (2, CLASS | 2, 8, 1)], envelopes
    finally:
        harness.close_all(ts)


def check_pattern_keeps_mpi_order(make: Factory) -> None:
    """Plain and pattern receives share MPI's order; messages of one (peer, tag) never overtake.

    Posted first: a message goes to the earliest posted receive that matches
    it, plain or pattern. Arrived first: a pattern receive takes the earliest
    filed message it matches, and a later plain receive the next one.
    """
    ts = harness.made(make, 2)
    try:

        def body(t: Transport) -> None:
            tag = CLASS | 1
            if t.rank == 1:
                hs = [t.isend(0, tag, harness.mv(harness.pattern(16, i)), 2) for i in range(3)]
                harness.ok(t, hs)
                later = [
                    t.isend(0, CLASS | 2, harness.mv(harness.pattern(16, 3)), 2),
                    t.isend(0, tag, harness.mv(harness.pattern(16, 4)), 2),
                    t.isend(0, tag, harness.mv(harness.pattern(16, 5)), 2),
                    t.isend(0, 0x7000, harness.mv(harness.pattern(1, 9)), 2),  # the fence
                ]
                harness.ok(t, later)
                return
            m = _matching(t)
            got = [np.zeros(16, np.uint8) for _ in range(6)]
            hs = [
                m.irecv_match([1], CLASS, ANY_IN_CLASS, harness.mv(got[0]), 2),
                t.irecv(1, tag, harness.mv(got[1]), 2),
                m.irecv_match(None, tag, -1, harness.mv(got[2]), 2),
            ]
            harness.ok(t, hs)
            # The fence comes after the others on the one link: once it is in, so are they.
            _done(t, t.irecv(1, 0x7000, harness.mv(np.zeros(1, np.uint8)), 2))
            h3 = m.irecv_match([1], CLASS, ANY_IN_CLASS, harness.mv(got[3]), 2)
            h4 = m.irecv_match(None, tag, -1, harness.mv(got[4]), 2)
            h5 = t.irecv(1, tag, harness.mv(got[5]), 2)
            harness.ok(t, [h3, h4, h5])
            assert m.envelope(h3)[:2] == (1, CLASS | 2), m.envelope(h3)
            for i in range(6):
                np.testing.assert_array_equal(got[i], harness.pattern(16, i), err_msg=f"recv {i}")

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_probe(make: Factory) -> None:
    """A probe reports a message's envelope and leaves it for a receive; waiting probes see it.

    A probe posted before the message completes when it arrives; one posted
    after completes at once; both report the same message, which the receive
    then takes. A probe whose message never comes can be withdrawn.
    """
    ts = harness.made(make, 2)
    go = threading.Event()
    try:

        def body(t: Transport) -> None:
            if t.rank == 1:
                assert go.wait(WAIT)
                harness.ok(t, [t.isend(0, CLASS | 7, harness.mv(harness.pattern(300, 7)), 4)])
                return
            m = _matching(t)
            early = m.probe(None, CLASS, ANY_IN_CLASS)
            never = m.probe([1], CLASS | 8, -1)
            assert not m.wait_any([early], 0.0), "a probe completed before any message"
            go.set()
            _done(t, early)
            late = m.probe([1], CLASS | 7, -1)
            assert late.done, "a probe of a message already in did not complete at once"
            for h in (early, late):
                assert m.envelope(h) == (1, CLASS | 7, 300, 4), m.envelope(h)
            got = np.zeros(300, np.uint8)
            _done(t, t.irecv(1, CLASS | 7, harness.mv(got), 4))
            np.testing.assert_array_equal(got, harness.pattern(300, 7))
            assert not never.done
            assert m.withdraw(never), "a waiting probe could not be withdrawn"
            assert never.done
            assert never.error is None
            assert not m.withdraw(late), "a done probe was withdrawn"

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_withdraw(make: Factory) -> None:
    """Withdrawing a receive that matched nothing frees its message for the next receive.

    Plain and pattern receives alike; a done receive is not withdrawn.
    """
    ts = harness.made(make, 2)
    go = threading.Event()
    try:

        def body(t: Transport) -> None:
            if t.rank == 1:
                assert go.wait(WAIT)
                hs = [t.isend(0, CLASS | i, harness.mv(harness.pattern(8, i)), 5) for i in (1, 2)]
                harness.ok(t, hs)
                return
            m = _matching(t)
            dead = [np.full(8, 0xEE, np.uint8) for _ in range(2)]
            gone = [
                t.irecv(1, CLASS | 1, harness.mv(dead[0]), 5),
                m.irecv_match(None, CLASS, ANY_IN_CLASS, harness.mv(dead[1]), 5),
            ]
            for h in gone:
                assert m.withdraw(h), f"could not withdraw {h!r}"
                assert h.done
                assert h.error is None
            go.set()
            got = [np.zeros(8, np.uint8) for _ in range(2)]
            hs = [
                m.irecv_match([1], CLASS, ANY_IN_CLASS, harness.mv(got[0]), 5),
                t.irecv(1, CLASS | 2, harness.mv(got[1]), 5),
            ]
            harness.ok(t, hs)
            for i in (0, 1):
                np.testing.assert_array_equal(got[i], harness.pattern(8, i + 1))
                assert (dead[i] == 0xEE).all(), "a withdrawn receive was written"
                assert not m.withdraw(hs[i]), "a done receive was withdrawn"

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)


def check_pattern_lost_peers(make: Factory) -> None:
    """A lost peer fails the patterns that need it: from it alone, or from peers all lost.

    Rank 2 closes: a pattern from rank 2 fails with PeerLostError; one from
    any peer goes on, and takes rank 1's message. Then rank 1 closes too:
    waiting any-peer probes fail, and so does every new any-peer receive.
    """
    ts = harness.made(make, 3)
    two_closed = threading.Event()
    sent = threading.Event()
    one_may_close = threading.Event()
    try:

        def body(t: Transport) -> None:
            if t.rank == 2:
                t.close()
                two_closed.set()
                return
            if t.rank == 1:
                assert two_closed.wait(WAIT)
                harness.ok(t, [t.isend(0, CLASS | 1, harness.mv(harness.pattern(8, 1)), 6)])
                sent.set()
                assert one_may_close.wait(WAIT)
                t.close()
                return
            m = _matching(t)
            got = np.zeros(8, np.uint8)
            from_two = m.irecv_match([2], CLASS, ANY_IN_CLASS, harness.mv(np.zeros(8, np.uint8)), 6)
            from_any = m.irecv_match(None, CLASS, ANY_IN_CLASS, harness.mv(got), 6)
            wait_all(t, [from_two])
            assert isinstance(from_two.error, PeerLostError), f"got {from_two.error!r}"
            assert sent.wait(WAIT)
            _done(t, from_any)
            np.testing.assert_array_equal(got, harness.pattern(8, 1))
            assert m.envelope(from_any)[0] == 1
            probe = m.probe(None, CLASS, ANY_IN_CLASS)
            one_may_close.set()
            wait_all(t, [probe])
            assert isinstance(probe.error, PeerLostError), f"got {probe.error!r}"
            again = m.irecv_match(None, CLASS, ANY_IN_CLASS, harness.mv(got), 6)
            assert again.done
            assert isinstance(again.error, PeerLostError), repr(again.error)

        run_ranks(ts, body)
    finally:
        harness.close_all(ts)
