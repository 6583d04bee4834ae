"""A ring of slots: the single-producer single-consumer queue of chunks from one rank to another.

Geometry, slot layout and the publish protocol: ``docs/transport.md`` (Note
[segment layout], Note [slot protocol]). The copy loops that fill and empty
rings live in :mod:`plait.transport.shm.link`, next to the matching they feed.
"""

from __future__ import annotations

import struct

from plait.transport.shm.segment import CONTROL_BYTES

__all__ = [
    "DEFAULT_SLOTS",
    "DEFAULT_SLOT_BYTES",
    "HDR",
    "SLOT_HEADER",
    "RingEnd",
    "default_slot_bytes",
    "geometry",
    "segment_bytes",
]

#: Payload bytes per slot by default (see :func:`default_slot_bytes` for many ranks).
DEFAULT_SLOT_BYTES = 1 << 20
#: Slots per ring by default.
DEFAULT_SLOTS = 4
#: Inbound ring memory a rank reserves at most when ``slot_bytes`` is not given.
_DEFAULT_INBOUND_BUDGET = 256 << 20
_MIN_DEFAULT_SLOT_BYTES = 64 << 10

_PAGE = 4096
_LINE = 64
#: Bytes of a slot's header, before its payload.
SLOT_HEADER = 64
_RING_HEADER = 128
# Word indexes (8-byte units) into a ring's header.
_W_HEAD, _W_TAIL = 0, 64 // 8
#: A chunk's header: tag, check, nbytes (of the whole message), offset (of this chunk).
HDR = struct.Struct("<QQQQ")


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def geometry(slots: int, slot_bytes: int) -> tuple[int, int]:
    """(stride, ring_bytes) of a ring: bytes per slot and per ring, rounded up."""
    stride = SLOT_HEADER + _round_up(slot_bytes, _LINE)
    return stride, _round_up(_RING_HEADER + slots * stride, _PAGE)


def segment_bytes(size: int, slots: int, slot_bytes: int) -> int:
    """Bytes of a segment among ``size`` ranks: the control block and ``size - 1`` rings."""
    return CONTROL_BYTES + (size - 1) * geometry(slots, slot_bytes)[1]


def default_slot_bytes(size: int, slots: int) -> int:
    """1 MiB slots, shrunk so the inbound rings of one rank stay within 256 MiB."""
    peers = max(size - 1, 1)
    fit = _DEFAULT_INBOUND_BUDGET // (peers * slots)
    fit = max(_MIN_DEFAULT_SLOT_BYTES, 1 << max(fit.bit_length() - 1, 0))
    return min(DEFAULT_SLOT_BYTES, fit)


class RingEnd:
    """One end of the ring from ``src`` to ``dst`` (in ``dst``'s segment).

    The sender keeps ``head`` (published) and the ``tail`` it last read; the
    receiver keeps ``tail`` (consumed) and the ``head`` it last read.

    Attributes:
        head_word, tail_word: the word indexes of the counters in the segment.
        slot0: byte offset of slot 0 in the segment.
        slots, slot_bytes, stride: the ring's geometry (the receiver's choice).
    """

    __slots__ = ("head", "head_word", "slot0", "slot_bytes", "slots", "stride", "tail", "tail_word")

    def __init__(self, src: int, dst: int, slots: int, slot_bytes: int) -> None:
        stride, ring_bytes = geometry(slots, slot_bytes)
        k = src if src < dst else src - 1  # rings are in source order, none from dst itself
        ring = CONTROL_BYTES + k * ring_bytes
        self.head_word = ring // 8 + _W_HEAD
        self.tail_word = ring // 8 + _W_TAIL
        self.slot0 = ring + _RING_HEADER
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.stride = stride
        self.head = 0
        self.tail = 0
