"""The sweep through mpi4py: ``mpirun -np N python -m plait.bench.compare.mpi_worker SPEC.json``.

Each plait collective maps to its MPI call on the same numpy buffers
(``Allreduce``, ``Reduce``, ``Bcast``, ``Reduce_scatter_block``,
``Allgather``, ``Alltoall``, ``Gather``, ``Scatter``, ``Barrier``), with
``MPI.IN_PLACE`` in place. MPI has no average: AVG is SUM followed by a
division on the ranks that get the result, as an MPI user would write it.
On bool, the ops become MPI's logical ones (SUM and MAX are LOR, PROD and
MIN LAND, BXOR LXOR). Which algorithm Open MPI runs is its own choice
(``coll/tuned``); the table says ``ompi``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from plait.bench.data import Buffers
from plait.bench.loop import Prepared, SweepSpec, Unsupported, worker_main
from plait.bench.sweep import Point
from plait.collectives import get as collective_of

__all__ = ["MPIBackend", "main"]


class MPIBackend:
    """mpi4py's collectives on COMM_WORLD, bound to the bench's buffers."""

    def __init__(self, MPI: Any) -> None:
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    def _op(self, name: str, dtype: np.dtype) -> Any:
        MPI = self.MPI
        if dtype.kind == "b":
            logical = {"sum": "LOR", "max": "LOR", "bor": "LOR", "prod": "LAND", "min": "LAND"}
            logical |= {"band": "LAND", "bxor": "LXOR"}
            return getattr(MPI, logical[name])
        return getattr(MPI, {"avg": "SUM", "prod": "PROD"}.get(name, name.upper()))

    def prepare(self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str) -> Prepared:
        """A zero-argument call of the row's MPI collective on ``bufs``."""
        MPI, comm, c, root = self.MPI, self.comm, spec.collective, spec.root
        IN_PLACE = MPI.IN_PLACE
        inp, out = bufs.inp, bufs.out
        in_place = spec.in_place
        is_root = self.rank == root
        if c != "barrier":
            from mpi4py.util.dtlib import from_numpy_dtype

            dtype = (inp if inp is not None else out).dtype  # type: ignore[union-attr]
            try:
                from_numpy_dtype(dtype).Free()
            except Exception as exc:
                raise Unsupported(f"MPI has no datatype for {dtype}") from exc
        op = self._op(spec.op, dtype) if collective_of(c).reduces else None
        check = out
        call: Callable[[], Any]
        if c == "allreduce":
            call = (
                (lambda: comm.Allreduce(IN_PLACE, out, op))
                if in_place
                else (lambda: comm.Allreduce(inp, out, op))
            )
        elif c == "reduce":
            if is_root and in_place:
                call = lambda: comm.Reduce(IN_PLACE, out, op, root)  # noqa: E731
            else:
                call = lambda: comm.Reduce(inp, out, op, root)  # noqa: E731
        elif c == "broadcast":
            call = lambda: comm.Bcast(out, root)  # noqa: E731
        elif c == "reduce_scatter":
            if in_place:  # MPI leaves this rank's block at the front of the buffer
                call = lambda: comm.Reduce_scatter_block(IN_PLACE, inp, op)  # noqa: E731
                check = inp[: point.count // self.size]  # type: ignore[index]
            else:
                call = lambda: comm.Reduce_scatter_block(inp, out, op)  # noqa: E731
        elif c == "allgather":
            call = (
                (lambda: comm.Allgather(IN_PLACE, out))
                if in_place
                else (lambda: comm.Allgather(inp, out))
            )
        elif c == "alltoall":
            call = (
                (lambda: comm.Alltoall(IN_PLACE, out))
                if in_place
                else (lambda: comm.Alltoall(inp, out))
            )
        elif c == "gather":
            if is_root and in_place:
                call = lambda: comm.Gather(IN_PLACE, out, root)  # noqa: E731
            else:
                call = lambda: comm.Gather(inp, out, root)  # noqa: E731
        elif c == "scatter":
            if is_root and in_place:
                call = lambda: comm.Scatter(inp, IN_PLACE, root)  # noqa: E731
            else:
                call = lambda: comm.Scatter(inp, out, root)  # noqa: E731
        elif c == "barrier":
            call = comm.Barrier
        else:
            raise ValueError(f"unknown collective {c!r}")
        if spec.op == "avg" and check is not None and (c != "reduce" or is_root):
            inner, target, n = call, check, self.size

            def call() -> None:
                inner()
                np.divide(target, n, out=target)

        return Prepared(call, "ompi", check)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` everywhere."""
        return int(self.comm.bcast(value, root=0))

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        """Every rank's ``row`` stacked on rank 0."""
        row = np.ascontiguousarray(row, np.float64)
        table = np.empty((self.size, row.size)) if self.rank == 0 else None
        self.comm.Gather(row, table, root=0)
        return table


def _make(spec: SweepSpec) -> tuple[MPIBackend, dict[str, Any], Callable[[], None]]:
    try:
        import mpi4py
        from mpi4py import MPI
    except ImportError as exc:
        raise Unsupported(f"mpi4py cannot be imported: {exc}") from exc
    library = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
    info = {
        "mpi4py": mpi4py.__version__,
        "mpi": library.split(",")[0],  # "Open MPI v4.1.4"
        "mpi_library": library,
        "btl": spec.options.get("btl", ""),
    }
    return MPIBackend(MPI), info, lambda: None


def main() -> None:
    """Run the sweep named on the command line on this MPI rank."""
    worker_main(_make)


if __name__ == "__main__":
    main()
