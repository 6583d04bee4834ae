"""The TCP wire format: frame kinds, the frame header, the hello, and striping arithmetic.

Every frame starts with a 24-byte header ``<kind u8, pad 3, check u32, tag u64,
nbytes u64>``; ``docs/transport.md`` (Note [TCP frames]) says what each kind carries.
"""

from __future__ import annotations

import struct

from plait.errors import PeerLostError, TransportError

__all__ = [
    "BYE",
    "CHUNK",
    "CTS",
    "DATA",
    "EAGER_MAX",
    "HDR",
    "HDR_SIZE",
    "HELLO",
    "ID",
    "KIND_NAMES",
    "MAGIC",
    "MAX_STREAMS",
    "PART",
    "RDATA",
    "REFUSE",
    "RTS",
    "RTS_SIZE",
    "SOCKET_BUFFER",
    "STRIPE_MIN",
    "VERSION",
    "WITHDRAW",
    "PeerProtocolError",
    "part",
]

#: Messages of at least this many bytes are striped over all streams of a pair.
STRIPE_MIN = 256 * 1024
#: Largest message sent eagerly; larger ones wait for the receiver's clear-to-send.
#:
#: This bounds what one unexpected message can make a receiver allocate (and
#: what a peer may announce in a ``DATA`` header). Below it a message costs no
#: handshake, which matters for the latency-bound small messages of
#: collectives. Above it the handshake costs about one small-message round
#: trip (0.1 ms between two Python processes on one host), which the payload
#: repays: moving 512 KiB takes longer than that, and the payload lands in the
#: posted receive instead of an unexpected-message buffer that must be
#: allocated and copied out; measured on loopback, messages from 512 KiB up
#: stream at least as fast with the handshake as without. It also stays well
#: under :data:`SOCKET_BUFFER`, so an eager send completes into the kernel's
#: buffer even while its receiver is busy elsewhere.
EAGER_MAX = 512 * 1024
#: Largest frame of a rendezvous payload on stream 0, in bytes.
#:
#: A payload (part 0 of it, if striped) goes out as ``RDATA`` frames of at most
#: this many bytes, and the frames that answer or withdraw an announcement
#: (``CTS``, ``REFUSE``, ``WITHDRAW``) may go between two of them. A clear-to-send
#: for a message coming the other way thus waits behind at most one chunk in
#: this rank's queue, instead of behind a whole payload: two ranks exchanging
#: large messages over one connection send both ways at once. Smaller chunks
#: cut that wait (one chunk at 25 MB/s is 20 ms) but cost a header, a send
#: call and a receive call each; 512 KiB measured as fast as one frame per
#: payload on loopback.
CHUNK = 512 * 1024
#: SO_SNDBUF and SO_RCVBUF asked for on every connection, in bytes.
SOCKET_BUFFER = 4 * 1024 * 1024
#: Most connections per rank pair.
MAX_STREAMS = 64

MAGIC = b"PLTC"
VERSION = 3  # 2: eager limit and rendezvous for large messages; 3: chunked RDATA
HELLO = struct.Struct("<4sHHIII")  # magic, version, stream index, rank, size, streams
HDR = struct.Struct("<BxxxIQQ")  # kind, check, tag (or striped sequence number), nbytes
HDR_SIZE = HDR.size
ID = struct.Struct("<Q")  # the message id that follows an RTS header
RTS_SIZE = HDR_SIZE + ID.size
DATA, PART, BYE, RTS, CTS, REFUSE, RDATA, WITHDRAW = 1, 2, 3, 4, 5, 6, 7, 8
KIND_NAMES = {
    DATA: "DATA",
    PART: "PART",
    BYE: "BYE",
    RTS: "RTS",
    CTS: "CTS",
    REFUSE: "REFUSE",
    RDATA: "RDATA",
    WITHDRAW: "WITHDRAW",
}


class PeerProtocolError(PeerLostError, TransportError):
    """A peer sent a frame that breaks the wire protocol; it now counts as lost.

    Both a :class:`~plait.errors.PeerLostError` (its connections are closed and
    every operation with it fails) and a :class:`~plait.errors.TransportError`
    (the cause is not a closed or dead process but a buggy or hostile peer).
    """


def part(nbytes: int, streams: int, k: int) -> tuple[int, int]:
    """Byte range [lo, hi) of part k when ``nbytes`` are striped over ``streams``."""
    chunk = -(-nbytes // streams)
    chunk = (chunk + 4095) & ~4095  # page-aligned parts
    lo = min(k * chunk, nbytes)
    return lo, min(lo + chunk, nbytes)
