"""What the shared-memory rendezvous hands the link: a :class:`Wire` per peer, and
:class:`Joined`, the whole result (:func:`plait.transport.shm.bootstrap.join`)."""

from __future__ import annotations

import socket

from plait.transport.shm.ring import RingEnd
from plait.transport.shm.segment import Segment

__all__ = ["Joined", "Wire"]


class Wire:
    """What the rendezvous set up with one peer: its socket, process, segment and both rings."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.name = ""  # its segment's and socket's name (announced in the store)
        self.nbytes = 0  # its segment's size (announced in the store)
        self.sock: socket.socket | None = None
        self.pid = 0  # its process id, if another process visible from here
        self.pid_start: str | None = None  # and its start time, if /proc tells
        self.seg: Segment | None = None
        self.out: RingEnd | None = None  # our ring in its segment
        self.inbound: RingEnd | None = None  # its ring in ours
        self.window = (0, 0)  # its arena: byte offset in its segment, bytes per half

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.seg is not None:
            self.seg.release()
            self.seg = None


class Joined:
    """The result of :func:`join`: the job, this rank's segment and a :class:`Wire` per peer.

    ``window`` is this rank's arena: (byte offset in its segment, bytes per half),
    (0, 0) without one.
    """

    def __init__(self, job: str, seg: Segment, wires: list[Wire], window: tuple[int, int]) -> None:
        self.job = job
        self.seg = seg
        self.wires = wires
        self.window = window
