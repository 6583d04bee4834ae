"""The shared-memory link: rings between the ranks of one host, driven by the endpoint.

Protocol: ``docs/transport.md`` (Note [slot protocol], Note [doorbells and
waiting], Note [unexpected messages]). The link also completes the counter waits of
the window (:mod:`plait.transport.shm.window`), so that they sleep and fail like messages.
"""

from __future__ import annotations

import math
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plait.errors import PeerLostError
from plait.transport.base import OTHER_MEMBER, closed_peer
from plait.transport.endpoint import Endpoint
from plait.transport.link import Message, Op, copy_bytes
from plait.transport.shm.doorbell import alive, drain, ring
from plait.transport.shm.ring import HDR, SLOT_HEADER, RingEnd
from plait.transport.shm.segment import W_CLOSED, W_SLEEPING, Fence, Segment
from plait.transport.shm.wire import Joined, Wire

if TYPE_CHECKING:
    from plait.transport.shm.window import CounterWait, ShmWindow

__all__ = ["ShmLink"]

#: Seconds between checks that peer processes still exist (a backup for end-of-file, which
#: never comes while a child the peer forked still holds its socket); also the longest sleep.
PID_INTERVAL = 1.0


class _Peer:
    """Everything about one peer: its socket, its segment, both rings, the message arriving."""

    def __init__(self, wire: Wire) -> None:
        assert wire.out is not None
        assert wire.inbound is not None
        self.rank = wire.rank
        self.sock = wire.sock
        self.pid = wire.pid
        self.pid_start = wire.pid_start
        self.seg: Segment | None = wire.seg
        self.out: RingEnd = wire.out
        self.inbound: RingEnd = wire.inbound
        self.lost: str | None = None
        self.closed = False  # lost by closing its transport, not by dying
        self.sendq: deque[Op] = deque()
        # The message being received from this peer, if any.
        self.cur_active = False
        self.cur_nbytes = 0
        self.cur_got = 0
        self.cur_op: Op | None = None
        self.cur_entry: Message | None = None


class ShmLink:
    """The link of one rank to the other ranks of its host, through shared-memory rings.

    Args:
        endpoint: the rank's endpoint (its lock guards this link).
        joined: what the rendezvous set up (this rank's segment, a wire per peer); the
            link owns it, and releases it if it cannot be made.
    """

    def __init__(self, endpoint: Endpoint, joined: Joined) -> None:
        #: A rank alone on its host has nothing to drive (its link only owns its segment).
        self.driven = bool(joined.wires)
        #: The job id in the names of this link's segments and sockets.
        self.job = joined.job
        self._ep = endpoint
        self._seg: Segment | None = joined.seg
        self._words: Any = joined.seg.words
        self._mv: Any = joined.seg.mv
        self._arr: Any = joined.seg.arr
        self._fence = Fence()
        self._peers = [_Peer(w) for w in joined.wires]
        self.by_rank = {p.rank: p for p in self._peers}
        self._by_fd: dict[int, _Peer] = {}
        #: Waits for peers' window counters, completed in progress().
        self._counters: list[CounterWait] = []
        #: The windows of split groups over this link (Note [split windows]), released with it.
        self._windows: weakref.WeakSet[ShmWindow] = weakref.WeakSet()
        self._last_pid_check = time.monotonic()
        try:  # the endpoint's epoll may find no descriptor left
            for p in self._peers:
                assert p.sock is not None
                self._by_fd[p.sock.fileno()] = p
                endpoint.watch(p.sock.fileno(), self._on_socket)
        except BaseException:
            self.release()
            raise

    @property
    def peers(self) -> list[int]:
        """The ranks this link reaches."""
        return [p.rank for p in self._peers]

    # -- the link interface (endpoint lock held) -------------------------------------------------
    def send(self, op: Op) -> None:
        """Queue ``op`` on its peer's ring and copy what fits now."""
        p = self.by_rank[op.peer]
        self._check_closed(p)
        if p.lost is not None:
            self._ep.fail(op, _lost_error(p))
        else:
            p.sendq.append(op)
            self._push(p)

    def recv_posted(self, op: Op) -> None:
        """Take ``op``'s message from the ring if it has arrived."""
        p = self.by_rank[op.peer]
        self._check_closed(p)
        if p.lost is None:
            self._pull(p, False)

    def claim(self, op: Op, msg: Message) -> None:
        """Copy what has arrived of ``msg``; the rest goes straight from the ring into ``op``."""
        if not self._ep.deliver_buffered(op, msg):
            for p in self._peers:
                if p.cur_entry is msg:  # still arriving
                    p.cur_entry, p.cur_op = None, op

    def reject(self, msg: Message, err: BaseException) -> None:
        """Drop ``msg``, and the rest of it if it is still arriving."""
        for p in self._peers:
            if p.cur_entry is msg:
                p.cur_entry = None

    def cancel(self, op: Op) -> None:
        """A send whose first chunks are in the ring is finished from a private copy."""
        p = self.by_rank[op.peer]
        if op.is_send:
            if op in p.sendq:
                if op.offset == 0:
                    p.sendq.remove(op)
                else:  # partly published: must finish, from our own copy
                    clone = Op(op.peer, op.tag, memoryview(bytes(op.buf)), 0, True)
                    clone.check, clone.offset = op.check, op.offset
                    p.sendq[p.sendq.index(op)] = clone
        elif p.cur_op is op:
            p.cur_op = None  # discard the rest of this message

    def progress(self, stalled: bool) -> bool:
        """One pass over every ring; whether any chunk moved.

        ``stalled``: unmatched messages are drained into private buffers
        (Note [unexpected messages]).
        """
        moved = False
        words = self._words
        for p in self._peers:
            if p.sendq and self._push(p):
                moved = True
            r = p.inbound
            # _pull's own first test, inlined: a polling round mostly finds nothing new.
            if (r.tail != r.head or r.tail != words[r.head_word]) and self._pull(p, stalled):
                moved = True
        if self._counters and self._poll_counters():
            moved = True
        return moved

    def arm(self) -> float:
        """Raise the sleeping flag (peers ring the doorbell) unless something can move now."""
        words = self._words
        words[W_SLEEPING] = 1
        self._fence()
        # Re-check after raising the flag: a publisher that missed the flag published before it.
        if self.progress(True):
            words[W_SLEEPING] = 0
            return 0.0
        if any(p.pid and p.lost is None for p in self._peers):
            return PID_INTERVAL
        return math.inf

    def disarm(self) -> None:
        """Lower the sleeping flag."""
        if self._words is not None:
            self._words[W_SLEEPING] = 0

    def check(self, now: float) -> None:
        """Every PID_INTERVAL: lose peers whose process is gone (see PID_INTERVAL)."""
        if now - self._last_pid_check < PID_INTERVAL:
            return
        self._last_pid_check = now
        for p in self._peers:
            if p.pid and p.lost is None and not alive(p.pid, p.pid_start):
                self._lose(p)

    def flush(self, err: BaseException) -> float | None:
        """Nothing to flush: queued sends fail at shutdown."""
        return None

    def shutdown(self, err: BaseException) -> None:
        """Fail queued sends and the receive being filled; tell peers through our closed flag."""
        ep = self._ep
        for w in self._counters:
            ep.fail(w, err)
        self._counters.clear()
        for p in self._peers:
            for op in p.sendq:
                ep.fail(op, err)
            p.sendq.clear()
            if p.cur_op is not None:
                ep.fail(p.cur_op, err)
                p.cur_op = None
        if self._seg is not None:
            self._seg.words[W_CLOSED] = 1
            self._fence()

    def release(self) -> None:
        """Close the sockets and unmap every segment, the groups' windows' too (idempotent)."""
        for window in list(self._windows):
            window.release()
        for p in self._peers:
            if p.sock is not None:
                self._ep.unwatch(p.sock.fileno())
                p.sock.close()
                p.sock = None
            if p.seg is not None:
                p.seg.release()
                p.seg = None
        self._by_fd.clear()
        if self._seg is not None:
            self._words = self._mv = self._arr = None
            self._seg.release()
            self._seg = None

    # -- window counters (endpoint lock held) ------------------------------------------------------
    def watch_counter(self, w: CounterWait) -> None:
        """Complete ``w`` once its peer's counter reaches its value; fail it if the peer is lost."""
        if w.words[w.index] >= w.value:
            self._ep.complete(w)
            return
        p = self.by_rank[w.peer]
        self._check_closed(p)
        if p.lost is not None:
            self._settle_lost(w, p)
        elif (absent := self._absent(w)) is not None:
            self._ep.fail(w, _member_lost(absent))
        else:
            self._counters.append(w)

    # Note [members lost]
    #     A wait on one peer's counter used to fail only when that peer was lost. A call
    #     of three ranks whose rank 2 waits on rank 1 (busy for a while) then heard of rank
    #     0's death only once rank 1 arrived, or at its timeout (arena_leader's first piece
    #     waits on the other non-leaders before the leader). A member of the window that is
    #     lost, closed or dead, before it began the call the wait is in (its counter at most
    #     the call's ``epoch << 32``, the previous call's end: no post of the call, nor its
    #     end) will never take part
    #     in it, so the wait fails at once, naming it. One that began the call may have done
    #     all it had to (it posted, or ended the call, then closed at the job's end), so its
    #     loss fails only the waits on it, as before.

    def _absent(self, w: CounterWait) -> _Peer | None:
        """A member of ``w``'s window lost before it began the call ``w`` waits in, which
        therefore cannot complete (Note [members lost]); None if there is none."""
        roots, counters = w.members
        begun = w.value >> 32 << 32
        for root, (words, index) in zip(roots, counters, strict=True):
            p = self.by_rank.get(root)
            if p is not None and p.lost is not None and words is not None and words[index] <= begun:
                return p
        return None

    def unwatch_counter(self, w: CounterWait) -> None:
        """Forget ``w`` (its wait timed out)."""
        if w in self._counters:
            self._counters.remove(w)

    def ring_sleepers(self, ranks: Sequence[int]) -> None:
        """Ring each live peer of ``ranks`` whose sleeping flag is up (after a counter store)."""
        for rank in ranks:
            p = self.by_rank[rank]
            if p.lost is None and p.seg is not None and p.seg.words[W_SLEEPING]:
                self._ring(p)

    def alive(self, rank: int) -> bool:
        """Whether peer ``rank`` is not lost, has not closed its transport (the closed
        word in its segment) and, if its process is visible, still runs.

        Reads only: callable without the endpoint's lock (a split's rendezvous). A
        peer whose segment this link no longer maps (the link is released) is not alive.
        """
        p = self.by_rank[rank]
        seg = p.seg
        if p.lost is not None or seg is None:
            return False
        try:
            if seg.words[W_CLOSED]:
                return False
        except (TypeError, ValueError):  # released meanwhile, on another thread
            return False
        return not p.pid or alive(p.pid, p.pid_start)

    def keep(self, window: ShmWindow) -> None:
        """Release a split group's ``window`` when this link is released.

        Held weakly: a window its group dropped goes with it; one its group
        released already is released again at no cost.
        """
        self._windows.add(window)

    def _poll_counters(self) -> bool:
        """Complete the counter waits whose counter has reached its value; whether any did."""
        ready = [w for w in self._counters if w.words[w.index] >= w.value]
        for w in ready:
            self._counters.remove(w)
            self._ep.complete(w)
        return bool(ready)

    def _settle_lost(self, w: CounterWait, p: _Peer) -> None:
        """``w``'s peer ``p`` is lost: what it posted before still counts, else PeerLostError."""
        if w.words[w.index] >= w.value:
            self._ep.complete(w)
        else:
            self._ep.fail(w, _lost_error(p))

    # -- rings -----------------------------------------------------------------------------------
    def _push(self, p: _Peer) -> bool:
        """Copy queued sends to ``p`` into free slots; whether any chunk was published."""
        queue = p.sendq
        if not queue or p.lost is not None or p.seg is None:
            return False
        seg = p.seg
        words, mv, arr = seg.words, seg.mv, seg.arr
        r = p.out
        slots, slot_bytes, stride, slot0 = r.slots, r.slot_bytes, r.stride, r.slot0
        head, tail = r.head, r.tail
        ep = self._ep
        moved = False
        while queue:
            if head - tail >= slots:
                tail = words[r.tail_word]
                if head - tail >= slots:
                    break
            op = queue[0]
            off = slot0 + (head % slots) * stride
            offset = op.offset
            n = min(slot_bytes, op.nbytes - offset)
            HDR.pack_into(mv, off, op.tag & 0xFFFFFFFFFFFFFFFF, op.check, op.nbytes, offset)
            copy_bytes(mv, arr, off + SLOT_HEADER, op.buf, op.arr, offset, n)
            op.offset = offset + n
            head += 1
            words[r.head_word] = head  # publish after the payload (Note [memory ordering])
            ep.bytes_sent += n
            moved = True
            if offset + n >= op.nbytes:
                queue.popleft()
                if not op.done:  # else cancelled
                    ep.complete(op)
        r.head, r.tail = head, tail
        if moved:
            self._fence()
            if words[W_SLEEPING]:
                self._ring(p)
        return moved

    def _pull(self, p: _Peer, stalled: bool) -> bool:
        """Copy published chunks from ``p`` out of our ring; whether any slot was freed."""
        words = self._words
        r = p.inbound
        head, tail = r.head, r.tail
        if tail == head:
            head = r.head = words[r.head_word]
            if tail == head:
                return False  # the common case while polling: nothing new
        mv, arr = self._mv, self._arr
        ep = self._ep
        slots, slot_bytes, stride, slot0 = r.slots, r.slot_bytes, r.stride, r.slot0
        moved = False
        while True:
            if tail == head:
                head = words[r.head_word]
                if tail == head:
                    break
            off = slot0 + (tail % slots) * stride
            if not p.cur_active:
                tag, check, nbytes, _ = HDR.unpack_from(mv, off)
                if tag >= 1 << 63:
                    tag -= 1 << 64
                op: Op | None = ep.take_posted(p.rank, tag)
                if op is not None:
                    err = ep.mismatch(op, check, nbytes)
                    if err is not None:
                        ep.fail(op, err)
                        op = None  # the message is consumed and dropped
                    p.cur_op, p.cur_entry = op, None
                elif stalled or p.lost is not None:
                    entry = Message(self, check, nbytes)
                    ep.add_unexpected(p.rank, tag, entry)
                    p.cur_op, p.cur_entry = None, entry
                else:
                    break  # leave it in the ring until its receive is posted
                p.cur_active, p.cur_nbytes, p.cur_got = True, nbytes, 0
            got = p.cur_got
            n = min(slot_bytes, p.cur_nbytes - got)
            op = p.cur_op
            if op is not None:
                copy_bytes(op.buf, op.arr, got, mv, arr, off + SLOT_HEADER, n)
                ep.bytes_received += n
            elif p.cur_entry is not None:
                data = p.cur_entry.data
                assert data is not None
                data[got : got + n] = arr[off + SLOT_HEADER : off + SLOT_HEADER + n]
                p.cur_entry.received = got + n
            got += n
            p.cur_got = got
            tail += 1
            words[r.tail_word] = tail  # free the slot only after copying out
            moved = True
            if got >= p.cur_nbytes:
                p.cur_active = False
                if op is not None:
                    ep.complete(op)
                    p.cur_op = None
                elif p.cur_entry is not None:
                    p.cur_entry.complete = True
                    p.cur_entry = None
        r.head, r.tail = head, tail
        if moved and p.seg is not None and p.lost is None:
            self._fence()
            if p.seg.words[W_SLEEPING]:
                self._ring(p)
        return moved

    def _ring(self, p: _Peer) -> None:
        """Ring ``p``'s doorbell (it is asleep in poll)."""
        if p.sock is not None:
            ring(p.sock)

    # -- peers closing and dying -------------------------------------------------------------------
    def _on_socket(self, fd: int, ready: int) -> None:
        p = self._by_fd.get(fd)
        if p is None or p.sock is None:
            return
        if not drain(p.sock):
            self._lose(p)

    def _check_closed(self, p: _Peer) -> None:
        """Notice at once that ``p`` has closed (its flag), before its end-of-file arrives."""
        if p.lost is None and p.seg is not None and p.seg.words[W_CLOSED]:
            self._lose(p)

    def _lose(self, p: _Peer) -> None:
        """``p`` closed or died: keep its whole messages, fail everything else involving it."""
        if p.lost is not None:
            return
        ep = self._ep
        closed = p.closed = p.seg is not None and p.seg.words[W_CLOSED] == 1
        name = ep.name(p.rank)
        # A transport closes with the communicator that owns it, the one a user knows:
        # every transport names a peer that closed so (Note [peers that close]).
        p.lost = (
            f"rank {name} has closed its communicator"
            if closed
            else f"rank {name} was lost: its process exited or was killed"
        )
        err = _lost_error(p)
        if p.sock is not None:
            ep.unwatch(p.sock.fileno())
            del self._by_fd[p.sock.fileno()]
            p.sock.close()
            p.sock = None
        self._pull(p, True)  # whole messages it published stay receivable
        if p.cur_active:  # it died mid-message
            if p.cur_op is not None:
                ep.fail(p.cur_op, err)
            elif p.cur_entry is not None:  # a partial unexpected message is worthless
                ep.discard(p.cur_entry)
            p.cur_active, p.cur_op, p.cur_entry = False, None, None
        for op in p.sendq:
            ep.fail(op, err)
        p.sendq.clear()
        for w in [w for w in self._counters if w.peer == p.rank]:
            self._counters.remove(w)
            self._settle_lost(w, p)
        for w in [w for w in self._counters if self._absent(w) is not None]:
            self._counters.remove(w)
            self._ep.fail(w, _member_lost(p))
        ep.lose(p.rank, err if closed else p.lost)


def _lost_error(p: _Peer) -> PeerLostError:
    """The error of an operation with lost peer ``p``: one that closed its transport is
    told apart from one that died (Note [peers that close] in plait.transport.base)."""
    assert p.lost is not None
    return closed_peer(p.lost) if p.closed else PeerLostError(p.lost)


def _member_lost(p: _Peer) -> PeerLostError:
    """The error of a wait on another peer whose call lost member ``p`` (Note [members
    lost]): it names ``p``, and says it is not the peer waited on (OTHER_MEMBER)."""
    err = PeerLostError(p.lost)
    setattr(err, OTHER_MEMBER, p.rank)
    return err
