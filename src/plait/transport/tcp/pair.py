"""The state of one TCP pair: a peer, its connections, their send queues and arriving messages."""

from __future__ import annotations

import socket
from collections import deque

from plait.transport.link import Message, Op
from plait.transport.tcp.wire import HDR_SIZE

__all__ = ["STAGE", "Conn", "Inbound", "Out", "Peer", "Rts"]

#: Bytes of the per-stream staging buffer for batched reads of small frames.
STAGE = 64 * 1024


class Inbound:
    """A message coming from a peer: matched to a receive, unexpected, or being discarded."""

    __slots__ = ("check", "left", "msg", "nbytes", "op", "peer", "seq", "view")

    def __init__(self, peer: Peer, check: int, nbytes: int) -> None:
        self.peer = peer
        self.check = check
        self.nbytes = nbytes
        self.op: Op | None = None  # the receive it was matched to
        self.msg: Message | None = None  # while it is an unexpected message at the endpoint
        self.view: memoryview | None = None  # where the payload goes; None = discard
        self.left = 1  # parts still arriving
        self.seq = -1  # sequence number among the pair's striped messages


class Rts:
    """A rendezvous message announced by a peer whose receive is not posted yet.

    All a receiver keeps for it (a few dozen bytes): the payload stays with the
    sender until a receive is posted and cleared.
    """

    __slots__ = ("check", "msg", "nbytes", "peer", "rid", "tag")

    def __init__(self, peer: Peer, check: int, tag: int, nbytes: int, rid: int) -> None:
        self.peer = peer
        self.check = check
        self.tag = tag
        self.nbytes = nbytes
        self.rid = rid
        self.msg: Message | None = None  # its record among the endpoint's unexpected messages


class Out:
    """One frame queued on a connection, or a rendezvous payload sent as a run of chunks.

    A chunked payload stays one queue entry: ``data`` is the chunk being sent
    (``hdr`` its header), ``rest`` what follows it (None for the last chunk or
    an ordinary frame); when a chunk is written the entry moves on to the next.
    """

    __slots__ = ("data", "hdr", "off", "op", "rest", "sent", "total", "urgent")

    def __init__(self, op: Op | None, hdr: bytes, data: memoryview, off: int) -> None:
        self.op = op
        self.hdr = hdr
        self.data = data
        self.off = off  # bytes of header + data already written
        self.total = HDR_SIZE + data.nbytes
        self.rest: memoryview | None = None  # chunked payload: the bytes after this chunk
        self.sent = 0  # chunked payload: bytes of the chunks already written
        self.urgent = False  # CTS, REFUSE, WITHDRAW: goes before every frame not started

    def started(self) -> bool:
        """Whether some of it is on the wire already (it must then go out whole)."""
        return self.off > 0 or self.sent > 0


class Conn:
    """One socket to a peer, with its read state and send queue."""

    __slots__ = (
        "cid",
        "cont",
        "due",
        "end",
        "events",
        "fd",
        "greedy",
        "hi",
        "index",
        "lo",
        "peer",
        "pos",
        "rec",
        "received",
        "sendq",
        "sent",
        "sock",
        "stage",
        "stop",
    )

    def __init__(self, peer: Peer, index: int, sock: socket.socket) -> None:
        self.peer = peer
        self.index = index
        self.sock: socket.socket | None = sock
        self.fd = sock.fileno()
        self.events = 0  # the epoll events the endpoint watches it for
        self.sendq: deque[Out] = deque()
        # Stream 0 reads greedily (many small frames per recv); the others read exactly
        # one part at a time, and only while a striped message owes them a part.
        self.greedy = index == 0
        self.stage = memoryview(bytearray(STAGE if self.greedy else HDR_SIZE))
        self.lo = 0
        self.hi = 0
        self.rec: Inbound | None = None  # message whose payload is being read
        self.pos = 0  # next byte of rec to read
        self.end = 0  # end of the frame being read
        self.stop = 0  # end of the part being read (beyond end while more chunks follow)
        # Stream 0, between two chunks of a rendezvous payload: its message and id. Only
        # its next chunk or a CTS, REFUSE or WITHDRAW may come until it is complete.
        self.cont: Inbound | None = None
        self.cid = -1
        self.due: deque[Inbound] = deque()  # striped messages whose part comes on this stream
        # Bytes read from and written to the socket so far: whether a look at it moved anything.
        self.received = 0
        self.sent = 0


class Peer:
    """Another rank: its connections and the state of the rendezvous messages with it."""

    __slots__ = (
        "cleared",
        "conns",
        "dead",
        "gone",
        "owed",
        "rank",
        "rid_in",
        "rid_out",
        "rts_in",
        "rts_out",
        "seq_in",
        "seq_out",
    )

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.conns: list[Conn] = []
        self.gone: BaseException | None = None  # set once it said goodbye or was lost
        self.dead = False  # its connections are closed
        self.seq_in = 0  # striped messages: sequence numbers in PART frames
        self.seq_out = 0
        # Parts of striped messages from it still owed on streams 1 and up: while any is,
        # stream 0 reads no further frame (Note [striped order] in plait.transport.tcp.reader).
        self.owed = 0
        # Sending: ids of our RTS frames, and the sends waiting for their answer (CTS or
        # REFUSE) with their RTS frame; the op is None once withdrawn (a tombstone kept
        # until the answer comes, so that the answer is not taken for a protocol error).
        self.rid_out = 0
        self.rts_out: dict[int, tuple[Op | None, Out]] = {}
        # Receiving: the last RTS id seen (ids only grow), the announced messages that no
        # receive has taken yet, and those cleared (CTS sent) whose RDATA has not begun.
        self.rid_in = -1
        self.rts_in: dict[int, Rts] = {}
        self.cleared: dict[int, Inbound] = {}
