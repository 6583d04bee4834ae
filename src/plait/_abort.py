"""What an abort does on one rank (Note [abort] in :mod:`plait._recovery`): the words of
its errors, its mark on a communicator's calls, the closing of its transport, and how
briefly it asks a store that may have stalled (Note [a store that stalls] there)."""

from __future__ import annotations

import _thread
import contextlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from plait.errors import AbortedError, CommError
from plait.rendezvous.store import answers_by
from plait.transport.endpoint import Endpoint

if TYPE_CHECKING:
    from plait.communicator import Communicator
    from plait.transport.base import Transport

__all__ = [
    "abort_alone",
    "abort_transport",
    "aborted_by",
    "as_split",
    "asking",
    "mark",
    "read_abort",
    "within",
]

_BY = "the communicator was aborted by rank"


def aborted_by(rank: int | str, reason: str) -> str:
    """What the errors of an abort say: who aborted, and why."""
    return f"{_BY} {rank}" + (f" ({reason})" if reason else "")


def read_abort(value: bytes, size: int) -> tuple[str, str, int]:
    """An ``abort/<rank>`` value of the store (``"<source>\\n<reason>"``, as a rank writes
    it) as the abort's text, its reason and its source rank; -1 where the source is no
    rank of the ``size``.

    Only a client with the job's secret writes the store, but a buggy one may write
    anything: a value that is not UTF-8 or whose source is no rank killed the watcher
    thread that read it (UnicodeDecodeError, ValueError), and with it the rank's heartbeat
    and every abort after. Such a value aborts all the same, said as it came.
    """
    source, _, reason = value.decode(errors="backslashreplace").partition("\n")
    if source.isdecimal() and source.isascii() and int(source) < size:
        return aborted_by(source, reason), reason, int(source)
    who = f"the communicator was aborted by a store client that is no rank of it ({source!r})"
    return who + (f" ({reason})" if reason else ""), reason, -1


def as_split(text: str) -> str:
    """:func:`aborted_by`'s ``text`` as a split's group says it: the rank that aborted is
    numbered by the communicator it was split from."""
    return text.replace(_BY, "the communicator it was split from was aborted by its rank", 1)


def mark(comm: Communicator, text: str) -> None:
    """Later calls of ``comm`` raise AbortedError with ``text``: plain stores, no lock."""
    runner = comm._runner
    runner.aborted = text
    if runner.broken is None:
        runner.broken = AbortedError(text)


def abort_alone(comm: Communicator, reason: str) -> None:
    """Abort ``comm`` without a store to tell its peers through: its calls fail, and its
    transport closes on a thread of its own (a signal handler may be calling)."""
    runner = comm._runner
    if runner.closed or runner.aborted is not None:
        return
    text = aborted_by(comm.rank, reason)
    mark(comm, text)
    _thread.start_new_thread(abort_transport, (comm._transport, comm.rank, text))


def _root(t: Transport) -> Transport:
    """The transport that owns the connections (a split's group: its parent's)."""
    while (parent := getattr(t, "parent", None)) is not None:
        t = parent
    return t


def abort_transport(t: Transport, rank: int, text: str) -> None:
    """Close ``t``'s connections, failing what is pending there with AbortedError."""
    root = _root(t)
    if isinstance(root, Endpoint):
        root.abort(lambda: AbortedError(f"rank {rank}: {text}"))
    else:
        root.close()


def asking(seconds: float) -> contextlib.AbstractContextManager[None]:
    """Within the block, this thread's store calls get their answers within ``seconds``, or
    fail: the store counts as gone, and the peers learn from the transport."""
    return answers_by(time.monotonic() + seconds)


def within(seconds: float, ask: Callable[[], object]) -> bool:
    """Whether ``ask()`` returned within ``seconds``, the store answering it: run on a
    thread of its own, which a stalled store may hold until its client gives up."""
    done, answered = threading.Event(), []

    def run() -> None:
        try:
            ask()
            answered.append(True)
        except (CommError, OSError):  # a store that is gone fails at once: say so at once
            pass
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    return done.wait(seconds) and bool(answered)
