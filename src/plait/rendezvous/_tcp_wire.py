"""The wire format of the built-in TCP store: frames, operation codes, statuses, fields.

Shared by the server (:mod:`plait.rendezvous._tcp_server`) and the client
(:class:`plait.rendezvous.tcp_store.TCPStore`), so that both read and write one format.

Note [wire protocol]
    Every message, in both directions, is one frame::

        +--------+-----------------+------------------------------------------+
        | code B | payload bytes Q | fields: (length I, bytes) repeated ...   |
        +--------+-----------------+------------------------------------------+

    (network byte order). A request's code is an :class:`Op`; a response's is a
    :class:`Status`. Keys travel as UTF-8, values as raw bytes, ``add``'s
    amount and result as decimal ASCII (arbitrary size), and the timeout of a
    blocking call as one big-endian double. Requests and fields:

    ======  =========================  =====================================
    op      request fields             OK response fields
    ======  =========================  =====================================
    SET     key, value                 (none)
    GET     timeout, key               value
    ADD     key, amount                new value
    WAIT    timeout, key...            (none)
    CHECK   key...                     b"1" or b"0"
    DELETE  key                        b"1" or b"0" (whether it existed)
    ======  =========================  =====================================

    A TIMEOUT response carries the keys still missing; an ERROR response one
    message. A connection carries one request at a time (the client holds a
    pool of connections so that threads sharing a client don't queue behind
    each other's blocking calls).
"""

from __future__ import annotations

import enum
import os
import re
import socket
import struct
from collections.abc import Sequence

__all__ = [
    "DEFAULT_MAX_VALUE",
    "FIELD",
    "HEADER",
    "MAX_PAYLOAD",
    "REQUEST_OVERHEAD",
    "SECONDS",
    "BadRequest",
    "Op",
    "Status",
    "frame",
    "key_list",
    "max_value_bytes",
    "recv_exact",
    "split_fields",
]

#: A frame's header: its code (an Op or a Status) and the length of its payload.
HEADER = struct.Struct("!BQ")
#: The length that precedes every field of a payload.
FIELD = struct.Struct("!I")
#: The timeout field of a blocking call (GET, WAIT): seconds as a double.
SECONDS = struct.Struct("!d")

#: Largest frame either side accepts (a frame bigger than this is a corrupt stream).
MAX_PAYLOAD = 1 << 32

#: Largest value a store holds unless PLAIT_STORE_MAX_VALUE or ``max_value_bytes=`` says
#: otherwise. A store carries addresses, counters and small blobs; 64 MiB leaves room
#: for a large pickled object while bounding what one authenticated client can make the
#: server buffer (a frame's length would allow 4 GiB).
DEFAULT_MAX_VALUE = 64 << 20
#: Bytes a request may carry besides its value: keys, field lengths, a timeout.
REQUEST_OVERHEAD = 1 << 20

_SIZE = re.compile(r"\s*(\d+)\s*([kmg]?)(?:i?b)?\s*", re.IGNORECASE)


class Op(enum.IntEnum):
    """A request's code: what the client asks for (table in Note [wire protocol])."""

    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    DELETE = 6


class Status(enum.IntEnum):
    """A response's code: how the server answered."""

    OK = 0
    TIMEOUT = 1
    BAD_VALUE = 2  # add on a value that is not an integer
    BAD_REQUEST = 3  # a malformed request: a bug in a client


class BadRequest(Exception):
    """A well-framed request the server cannot understand."""


def frame(code: int, fields: Sequence[bytes]) -> bytes:
    """One whole frame: the header for ``code``, then every field with its length."""
    body = b"".join(FIELD.pack(len(f)) + f for f in fields)
    return HEADER.pack(code, len(body)) + body


def split_fields(payload: bytes) -> list[bytes]:
    """The fields of a frame's payload.

    Raises:
        BadRequest: a field's length runs past the payload's end.
    """
    fields = []
    pos = 0
    while pos < len(payload):
        if pos + FIELD.size > len(payload):
            raise BadRequest(f"truncated field header at byte {pos} of {len(payload)}")
        (length,) = FIELD.unpack_from(payload, pos)
        pos += FIELD.size
        if pos + length > len(payload):
            raise BadRequest(f"field of {length} bytes overruns the {len(payload)}-byte payload")
        fields.append(payload[pos : pos + length])
        pos += length
    return fields


def max_value_bytes(explicit: int | None = None) -> int:
    """The largest value a store accepts: ``explicit``, else PLAIT_STORE_MAX_VALUE, else 64 MiB.

    PLAIT_STORE_MAX_VALUE is a byte count with an optional binary suffix (``65536``,
    ``64K``, ``256M``, ``1G``). Server and clients read it alike, so a client refuses
    an oversized value itself, naming the key, before sending it.

    Raises:
        ValueError: the setting is not a positive size.
    """
    if explicit is not None:
        if explicit < 1:
            raise ValueError(f"max_value_bytes must be at least 1, got {explicit}")
        return int(explicit)
    text = os.environ.get("PLAIT_STORE_MAX_VALUE", "")
    if not text.strip():
        return DEFAULT_MAX_VALUE
    match = _SIZE.fullmatch(text)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(
            f"PLAIT_STORE_MAX_VALUE={text!r} is not a size in bytes (e.g. 67108864 or 64M)"
        )
    shift = {"": 0, "k": 10, "m": 20, "g": 30}[match.group(2).lower()]
    return int(match.group(1)) << shift


def key_list(keys: Sequence[bytes]) -> list[str]:
    """Keys from the wire as text, for messages (bytes that are not UTF-8 replaced)."""
    return [k.decode("utf-8", "replace") for k in keys]


def recv_exact(sock: socket.socket, nbytes: int) -> bytearray:
    """Exactly ``nbytes`` from a blocking ``sock``.

    Raises:
        ConnectionError: the peer closed the connection first.
        OSError: the socket failed or timed out.
    """
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the server closed the connection")
        got += n
    return buf
