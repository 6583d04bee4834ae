"""The plait rank body of ``plait bench``: ``python -m plait.bench.worker SPEC.json``.

Started on every rank by ``plait run``'s launcher, so it meets the others
with a bare :func:`plait.init` (transport from PLAIT_TRANSPORT), then runs
the sweep of :mod:`plait.bench.loop` with ``--timeout`` as its calls' timeout
(Note [the bench's timeout]).
"""

# Note [the bench's timeout]
#     ``plait bench --timeout S`` bounds each call, not the rendezvous: plait.init keeps
#     its own deadline (PLAIT_TIMEOUT where the user set it, else 300 s). The launcher
#     used to pass S as PLAIT_TIMEOUT, which plait.init reads for both, so that a tiny
#     call timeout (1e-6) failed every rank in plait.init (a StoreTimeout) and no call was
#     ever made. The worker sets S as the communicator's default timeout once it is made,
#     not as each call's ``timeout=``: a call given one leaves plait's short path (it cost
#     some 24 µs a call on a 2-core machine), which would be measured with it.
#     The bench's own calls between the timed ones (the agreed number of iterations,
#     the gathered times) are not timed: they keep the deadline plait.init had, each
#     given as its ``timeout=``. Under S they raised the error of the bench's broadcast
#     where a rank was a moment late to it, not of the timed call.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import plait
from plait._checks import check_timeout
from plait.bench.data import Buffers, resolve_dtype
from plait.bench.loop import Prepared, Refused, SweepSpec, op_by_name, worker_main
from plait.bench.sweep import Point, selection_bytes
from plait.collectives import get as collective_of
from plait.errors import UnsupportedError
from plait.schedule.builder import HostLayout
from plait.selection.select import select

__all__ = ["PlaitBackend", "main"]


class PlaitBackend:
    """plait's collectives, bound to the bench's buffers."""

    def __init__(self, comm: plait.Communicator, own_timeout: float | None = None) -> None:
        self.comm = comm
        #: the deadline of the bench's own calls (Note [the bench's timeout])
        self.own_timeout = comm.timeout if own_timeout is None else own_timeout
        self.rank = comm.rank
        self.size = comm.size
        layout = HostLayout.from_names(comm.hosts)
        self._layout = layout if layout.n_hosts > 1 else None

    def _auto(self, spec: SweepSpec, point: Point) -> str:
        """The algorithm ``auto`` runs for this row (decided as the Communicator decides)."""
        c = spec.collective
        itemsize = resolve_dtype(spec.dtype).itemsize
        nbytes = selection_bytes(c, point.count, itemsize, self.size)
        commutative = op_by_name(spec.op).commutative if collective_of(c).reduces else True
        shared = self.comm.window_bytes > 0
        return select(
            c, self.size, nbytes, commutative=commutative, hosts=self._layout, shared=shared
        ).name

    def _refuse(self, spec: SweepSpec, point: Point, algorithm: str) -> None:
        """Raise :class:`Refused` if this communicator cannot run ``algorithm``.

        Asked as a call asks it, before any byte moves (``Communicator._choose``: a
        one-sided algorithm where the ranks share no window, over TCP): the same answer
        on every rank, and the communicator stays usable, where the call itself would
        raise on every rank and print a traceback per rank.
        """
        c = spec.collective
        itemsize = resolve_dtype(spec.dtype).itemsize
        nbytes = selection_bytes(c, point.count, itemsize, self.size)
        op = op_by_name(spec.op) if collective_of(c).reduces else None
        try:
            self.comm._choose(c, algorithm, nbytes, op)
        except UnsupportedError as exc:
            raise Refused(str(exc)) from None

    def prepare(self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str) -> Prepared:
        """A zero-argument call of the row's collective on ``bufs``.

        Raises:
            Refused: this communicator cannot run ``algorithm`` (see :meth:`_refuse`).
        """
        comm, c, root, size = self.comm, spec.collective, spec.root, self.size
        op = op_by_name(spec.op)
        inp, out = bufs.inp, bufs.out
        if algorithm != "auto":
            self._refuse(spec, point, algorithm)
        name = self._auto(spec, point) if algorithm == "auto" else algorithm
        a = algorithm
        k = point.count // size
        call: Callable[[], Any]
        if c == "allreduce":
            call = lambda: comm.allreduce(inp, op, out=out, algorithm=a)  # noqa: E731
        elif c == "reduce":
            call = lambda: comm.reduce(inp, root, op, out=out, algorithm=a)  # noqa: E731
        elif c == "broadcast":
            call = lambda: comm.broadcast(out, root, algorithm=a)  # noqa: E731
        elif c == "reduce_scatter":
            call = lambda: comm.reduce_scatter(inp, op, out=out, algorithm=a)  # noqa: E731
        elif c == "allgather":
            grid = out.reshape(size, k)  # type: ignore[union-attr]
            call = lambda: comm.allgather(inp, out=grid, algorithm=a)  # noqa: E731
        elif c == "alltoall":
            call = lambda: comm.alltoall(inp, out=out, algorithm=a)  # noqa: E731
        elif c == "gather":
            grid = out.reshape(size, k) if out is not None else None
            call = lambda: comm.gather(inp, root, out=grid, algorithm=a)  # noqa: E731
        elif c == "scatter":
            call = lambda: comm.scatter(inp, root, out=out, algorithm=a)  # noqa: E731
        elif c == "barrier":
            call = comm.barrier if a == "auto" else lambda: comm.barrier(algorithm=a)
        else:
            raise ValueError(f"unknown collective {c!r}")
        return Prepared(call, name, out)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` everywhere."""
        ints = np.array([value], np.int64)
        return int(self.comm.broadcast(ints, 0, timeout=self.own_timeout)[0])

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        """Every rank's ``row`` stacked on rank 0."""
        row = np.ascontiguousarray(row, np.float64)
        rows: np.ndarray | None = self.comm.gather(row, 0, timeout=self.own_timeout)
        return rows


def _make(spec: SweepSpec) -> tuple[PlaitBackend, dict[str, Any], Callable[[], None]]:
    comm = plait.init()  # its own deadline, not --timeout (Note [the bench's timeout])
    backend = PlaitBackend(comm)
    timeout = spec.options.get("timeout")
    if timeout is not None:
        comm._runner.timeout = check_timeout(timeout, "--timeout")
    info = {"plait": plait.__version__, "numpy": np.__version__}
    return backend, info, comm.close


def main() -> None:
    """Run the sweep named on the command line on this rank."""
    worker_main(_make)


if __name__ == "__main__":
    main()
