"""The shared bounds on unauthenticated connections (Note [unauthenticated connections]).

The store server and the TCP setup are tested against real hostile peers in
tests/rendezvous/test_tcp_store_hostile.py and tests/transport/test_tcp_bootstrap.py;
these tests pin the policy itself: which connection goes at the cap, when deadlines
fall due, and the pause schedule of a listener out of descriptors.
"""

from __future__ import annotations

import errno
import logging
import resource
import selectors
import socket
import time
from collections.abc import Iterator

import pytest

from plait import _guard
from plait._guard import AcceptBackoff, PendingHandshakes, unauthenticated_cap

# -- PendingHandshakes -------------------------------------------------------------------


def test_admit_drops_the_oldest_at_the_cap() -> None:
    pending = PendingHandshakes[str](2, 10.0)
    assert pending.admit("a", 0.0) is None
    assert pending.admit("b", 1.0) is None
    assert pending.admit("c", 2.0) == "a"
    assert "a" not in pending
    assert len(pending) == 2
    pending.discard("b")  # authenticated: no longer counted
    assert pending.admit("d", 3.0) is None
    assert pending.clear() == ["c", "d"]
    assert len(pending) == 0


def test_overdue_returns_the_late_in_order_and_leaves_the_rest() -> None:
    pending = PendingHandshakes[str](8, 10.0)
    for i, name in enumerate("abc"):
        pending.admit(name, float(i))
    assert pending.next_deadline() == 10.0
    assert pending.overdue(9.9) == []
    assert pending.overdue(11.0) == ["a", "b"]  # a deadline equal to now is due
    assert pending.next_deadline() == 12.0
    assert list(pending.clear()) == ["c"]
    assert pending.next_deadline() is None


def test_discarding_an_unknown_connection_does_nothing() -> None:
    pending = PendingHandshakes[str](1, 1.0)
    pending.discard("never admitted")
    assert len(pending) == 0


@pytest.mark.parametrize("cap", [0, -1])
def test_a_cap_below_one_is_refused(cap: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PendingHandshakes[str](cap, 1.0)


# -- unauthenticated_cap -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("soft", "cap", "expected"),
    [
        (resource.RLIM_INFINITY, 256, 256),
        (1 << 20, 256, 256),  # plenty of descriptors: the cap as asked
        (400, 256, 100),  # a quarter of the limit
        (40, 256, 16),  # but never under the minimum
        (40, 4, 4),  # a cap under the minimum stays as asked
    ],
)
def test_the_cap_is_at_most_a_quarter_of_the_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch, soft: int, cap: int, expected: int
) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (soft, resource.RLIM_INFINITY))
    assert unauthenticated_cap(cap, 16) == expected


# -- AcceptBackoff -----------------------------------------------------------------------


class _Scripted(socket.socket):
    """A listening socket whose ``accept`` raises the errors a test lines up, then accepts."""

    def __init__(self) -> None:
        super().__init__(socket.AF_INET, socket.SOCK_STREAM)
        self.errors: list[OSError] = []
        self.calls = 0

    def accept(self) -> tuple[socket.socket, tuple[str, int]]:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return super().accept()


@pytest.fixture
def listener() -> Iterator[_Scripted]:
    sock = _Scripted()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


@pytest.fixture
def selector() -> Iterator[selectors.BaseSelector]:
    sel = selectors.DefaultSelector()
    yield sel
    sel.close()


def _emfile() -> OSError:
    return OSError(errno.EMFILE, "Too many open files")


def _watched(sel: selectors.BaseSelector, sock: socket.socket) -> bool:
    try:
        sel.get_key(sock)
    except KeyError:
        return False
    return True


def test_accepted_yields_connections_with_their_peer_then_stops_when_empty(
    listener: _Scripted, selector: selectors.BaseSelector
) -> None:
    backoff = AcceptBackoff(listener, selector, "rank 0")
    assert _watched(selector, listener)
    port = listener.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)) as c1:
        got = list(backoff.accepted(4))  # one queued: the second accept would block
        assert len(got) == 1
        sock, peer = got[0]
        with sock:
            assert peer == f"127.0.0.1:{c1.getsockname()[1]}"
    assert backoff.paused_until is None


def test_accepted_takes_at_most_the_number_asked(
    listener: _Scripted, selector: selectors.BaseSelector
) -> None:
    backoff = AcceptBackoff(listener, selector, "rank 0")
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    try:
        first = list(backoff.accepted(2))
        rest = list(backoff.accepted(2))
        assert (len(first), len(rest)) == (2, 1)
        for sock, _ in first + rest:
            sock.close()
    finally:
        for c in clients:
            c.close()


def test_a_connection_gone_before_accept_is_skipped(
    listener: _Scripted, selector: selectors.BaseSelector
) -> None:
    backoff = AcceptBackoff(listener, selector, "rank 0")
    listener.errors = [ConnectionAbortedError(errno.ECONNABORTED, "aborted")]
    with socket.create_connection(("127.0.0.1", listener.getsockname()[1])):
        got = list(backoff.accepted(4))
        for sock, _ in got:
            sock.close()
    assert len(got) == 1
    assert backoff.paused_until is None


def test_out_of_descriptors_pauses_doubling_logs_once_and_resumes(
    listener: _Scripted,
    selector: selectors.BaseSelector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="plait")
    backoff = AcceptBackoff(
        listener, selector, "rank 3", during="during the TCP setup", schedule=(0.05, 0.15)
    )
    # 0.05, 0.1, then the longest, 0.15, for good.
    for pause in (0.05, 0.1, 0.15, 0.15):
        listener.errors = [_emfile()]
        before = time.monotonic()
        assert list(backoff.accepted(4)) == []
        after = time.monotonic()
        until = backoff.paused_until
        assert until is not None
        assert before + pause <= until <= after + pause
        assert not _watched(selector, listener)
        backoff.resume(until - 0.001)  # not yet
        assert not _watched(selector, listener)
        backoff.resume(until)
        assert backoff.paused_until is None
        assert _watched(selector, listener)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "rank 3: out of file descriptors during the TCP setup (Too many open files): not "
        "accepting connections for now, retrying every 0.15 s at most; raise the limit "
        "(ulimit -n) if this is not an attack"
    ]


def test_out_of_descriptors_drops_the_oldest_authenticating_to_make_room(
    listener: _Scripted, selector: selectors.BaseSelector
) -> None:
    """The store held idle connections up to its cap, accept ran out of descriptors, and it
    paused for good: nothing was admitted, so nothing old was ever dropped, and the honest
    client queued behind them waited until they timed out."""
    backoff = AcceptBackoff(listener, selector, "store", schedule=(0.05, 0.15))
    pending = ["idle 1", "idle 2"]
    dropped: list[str] = []

    def make_room() -> bool:
        if not pending:
            return False
        dropped.append(pending.pop(0))
        return True

    listener.errors = [_emfile()]
    with socket.create_connection(("127.0.0.1", listener.getsockname()[1])):
        got = list(backoff.accepted(4, make_room))
        for sock, _ in got:
            sock.close()
    assert len(got) == 1
    assert dropped == ["idle 1"]
    assert backoff.paused_until is None
    # With nothing left to drop, it pauses as before.
    pending.clear()
    listener.errors = [_emfile()]
    assert list(backoff.accepted(4, make_room)) == []
    assert backoff.paused_until is not None
    table = PendingHandshakes[str](4, 10.0)
    table.admit("a", 0.0)
    table.admit("b", 1.0)
    assert table.oldest(admitted_by=0.5) == "a"
    assert table.oldest(admitted_by=0.5) is None  # "b" came later: kept
    assert (table.oldest(1.0), table.oldest(1.0)) == ("b", None)


def test_a_successful_accept_starts_the_schedule_over(
    listener: _Scripted, selector: selectors.BaseSelector
) -> None:
    backoff = AcceptBackoff(listener, selector, "store h:1")
    for _ in range(3):  # pauses of 0.05, 0.1, 0.2
        listener.errors = [_emfile()]
        list(backoff.accepted(1))
        until = backoff.paused_until
        assert until is not None
        backoff.resume(until)
    with socket.create_connection(("127.0.0.1", listener.getsockname()[1])):
        for sock, _ in backoff.accepted(1):
            sock.close()
    listener.errors = [_emfile()]
    before = time.monotonic()
    list(backoff.accepted(1))
    after = time.monotonic()
    until = backoff.paused_until
    assert until is not None
    assert before + 0.05 <= until <= after + 0.05  # the first pause again, not 0.4


def test_other_accept_errors_pause_too_but_are_not_warned_about(
    listener: _Scripted,
    selector: selectors.BaseSelector,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="plait")
    backoff = AcceptBackoff(listener, selector, "store h:1")
    listener.errors = [OSError(errno.EPROTO, "Protocol error")]
    assert list(backoff.accepted(4)) == []
    assert backoff.paused_until is not None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert caplog.records[0].getMessage() == "store h:1: accept failed: [Errno 71] Protocol error"


def test_the_defaults_are_the_documented_ones() -> None:
    assert _guard.HANDSHAKE_SECONDS == 10.0
    assert _guard.MAX_UNAUTHENTICATED == 256
    assert _guard.MIN_UNAUTHENTICATED == 16
    assert _guard.ACCEPT_BACKOFF == (0.05, 1.0)
