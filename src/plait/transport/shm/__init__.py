"""A shared-memory transport for ranks on one host: one ring of slots per ordered pair.

:class:`ShmTransport` is an :class:`~plait.transport.endpoint.Endpoint` whose
link to the other ranks of the host is a :class:`~plait.transport.shm.link.ShmLink`:
the sender copies a message into slots of a ring in the receiver's segment,
the receiver copies it out into the posted buffer. Its ``window`` is a
:class:`~plait.transport.shm.window.ShmWindow`: an arena at the end of each rank's
segment that the peers read in place. The modules, one noun each:
:mod:`~plait.transport.shm.segment` (the file and its mapping),
:mod:`~plait.transport.shm.ring` (ring geometry), :mod:`~plait.transport.shm.doorbell`
(wake-ups and liveness), :mod:`~plait.transport.shm.bootstrap` (the rendezvous),
:mod:`~plait.transport.shm.link` and :mod:`~plait.transport.shm.window`. The
protocol is described in ``docs/transport.md``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from plait.errors import ClosedError, CommError, TransportError
from plait.rendezvous.store import Store
from plait.transport.base import spin_seconds
from plait.transport.endpoint import Endpoint
from plait.transport.loopback import Loopback
from plait.transport.shm import bootstrap, segment
from plait.transport.shm import window as shm_window
from plait.transport.shm.link import ShmLink
from plait.transport.shm.ring import DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, default_slot_bytes
from plait.transport.shm.segment import SHM_DIR
from plait.transport.shm.window import ShmWindow

__all__ = ["DEFAULT_SLOTS", "DEFAULT_SLOT_BYTES", "SHM_DIR", "ShmTransport"]

#: Seconds a waiting rank polls before it sleeps (PLAIT_SHM_SPIN overrides it).
_SPIN = 50e-6


def _spin_from_env() -> float:
    """PLAIT_SHM_SPIN (microseconds a waiting rank polls before it sleeps), else the default."""
    return spin_seconds("PLAIT_SHM_SPIN", _SPIN)


class ShmTransport(Endpoint):
    """Rank ``rank``'s end of a shared-memory transport among ``size`` ranks on one host.

    The constructor is a collective rendezvous: every rank must construct its
    transport with the same store (threads of one process may, too). See
    ``docs/transport.md`` for the protocol.

    Args:
        rank: this rank, ``0 <= rank < size``.
        size: number of ranks, all on this host.
        store: rendezvous store shared by the ranks; keys go under ``plait-shm/``.
        timeout: seconds the rendezvous may take.
        job: job id that starts segment and socket names (``[A-Za-z0-9_.-]``,
            at most 64 characters; each rank ends its names in a random part of
            its own, see Note [segment names]); default: a random token drawn
            by rank 0.
        slot_bytes: payload bytes per ring slot (default 1 MiB, less for many
            ranks so that a rank's inbound rings stay within 256 MiB).
        slots: slots per ring (default 4).
        names: how messages name the ranks (default: their numbers here);
            a transport among some ranks of a larger job passes their ranks
            in the job, so that errors name the ranks the user knows.
        window_bytes: bytes of each of the two halves of this rank's window
            (default PLAIT_SHM_WINDOW, else 2 MiB; 0: no window). Ranks that
            differ get the smallest; if one has none, none has.

    Raises:
        RendezvousError: the ranks did not all arrive within ``timeout``.
        TransportError: the OS refused a segment, socket or descriptor (e.g. ``/dev/shm``
            full, or no descriptor left).
        UnsupportedError: no ``/dev/shm``, or a weakly ordered CPU without libatomic.
        ValueError: a bad argument, or PLAIT_SHM_WINDOW is not a size.

    Attributes:
        job: the job id in use.
        window: this rank's :class:`~plait.transport.shm.window.ShmWindow`, or
            None (disabled on some rank).
        bytes_sent: payload bytes copied into peers' rings so far.
        bytes_received: payload bytes delivered into posted receives so far
            (messages set aside as unexpected count once a receive takes them).
        spin: seconds a waiting rank polls before it sleeps (default 50 µs, or
            PLAIT_SHM_SPIN microseconds; 0 sleeps at once, which saves CPU
            when messages are rare).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        store: Store,
        *,
        timeout: float = 300.0,
        job: str | None = None,
        slot_bytes: int | None = None,
        slots: int | None = None,
        names: Sequence[int] | None = None,
        window_bytes: int | None = None,
    ) -> None:
        super().__init__(rank, size, names=names)
        if job is not None and not bootstrap.JOB_RE.fullmatch(job):
            raise ValueError(f"job must match [A-Za-z0-9_.-]{{1,64}}, got {job!r}")
        slots = DEFAULT_SLOTS if slots is None else slots
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        slot_bytes = default_slot_bytes(size, slots) if slot_bytes is None else slot_bytes
        if slot_bytes < 1:
            raise ValueError(f"slot_bytes must be at least 1, got {slot_bytes}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        window = shm_window.window_bytes(window_bytes)
        segment.check_platform()
        self.spin = _spin_from_env()
        if size > (os.cpu_count() or 1):
            # More ranks than cores: yield from the first idle poll, as a window's wait does,
            # so that a peer sharing our core can run (4 ranks on 2 cores, 8-byte allreduce by
            # messages: 137-177 against 125-211 us a call, 4 of 5 interleaved pairs faster).
            self.eager_spin = 0.0
        joined = bootstrap.join(
            rank,
            size,
            store,
            timeout=timeout,
            job=job,
            slots=slots,
            slot_bytes=slot_bytes,
            names=self._names,
            window=window,
        )
        self.job = joined.job
        try:
            link = ShmLink(self, joined)  # it owns what the rendezvous set up from here on
            self.attach(Loopback(self), [rank])
            self.attach(link, link.peers)
            self.window: ShmWindow | None = ShmWindow.build(self, link, joined)
        except BaseException as exc:
            self._release()  # (a link that could not be made released it itself)
            if isinstance(exc, OSError) and not isinstance(exc, CommError):
                raise TransportError(
                    f"rank {self._me}: setting up shared memory failed: {exc}"
                ) from exc
            raise

    def _closed_error(self) -> BaseException:
        return ClosedError(f"rank {self._me}: the shared-memory transport is closed")

    def _release(self) -> None:
        if self.window is not None:  # its views first, so that the segments can be unmapped
            self.window.release()
        super()._release()

    def __enter__(self) -> ShmTransport:
        return self

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<ShmTransport rank {self.rank} of {self.size}, job {self.job!r}, {state}>"
