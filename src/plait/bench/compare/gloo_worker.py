"""The sweep through torch.distributed's gloo backend.

``python -m plait.bench.compare.gloo_worker SPEC.json`` on every rank.

Started on every rank by ``plait run``'s launcher; the rank and world size
come from its PLAIT_RANK and PLAIT_SIZE, and the ranks meet at
``tcp://127.0.0.1:PORT`` (a free port the bench chose) with GLOO_SOCKET_IFNAME
set to the loopback interface. Gloo moves data over TCP only.

The buffers are the bench's numpy arrays, shared with torch through
``torch.from_numpy`` (no copy). Gloo's reductions work in place: out of
place, allreduce and reduce copy the input into the output first and reduce
there, as a torch user would. Dtypes gloo lacks (int16, the unsigned types
above uint8, longdouble) are reported as unsupported.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from plait.bench.data import Buffers
from plait.bench.loop import Prepared, SweepSpec, Unsupported, worker_main
from plait.bench.sweep import Point

__all__ = ["GlooBackend", "main"]

#: numpy dtype names gloo reduces and moves.
_SUPPORTED = {
    "bool",
    "uint8",
    "int8",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
}


class GlooBackend:
    """torch.distributed collectives over gloo, bound to the bench's buffers."""

    def __init__(self, torch: Any, dist: Any) -> None:
        self.torch = torch
        self.dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def _tensor(self, a: np.ndarray | None) -> Any:
        if a is None:
            return None
        if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: reinterpret the bits
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def prepare(self, spec: SweepSpec, point: Point, bufs: Buffers, algorithm: str) -> Prepared:
        """A zero-argument call of the row's torch.distributed collective on ``bufs``."""
        dist, c, root, size = self.dist, spec.collective, spec.root, self.size
        if c != "barrier" and spec.dtype not in _SUPPORTED:
            raise Unsupported(f"gloo does not support {spec.dtype}")
        if c == "alltoall" and spec.in_place:
            raise Unsupported(
                "torch.distributed has no in-place alltoall (all_to_all_single with one tensor "
                "as input and output returns wrong data)"
            )
        op = getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(spec.op, spec.op.upper()))
        inp, out = self._tensor(bufs.inp), self._tensor(bufs.out)
        is_root = self.rank == root
        k = point.count // size
        # Separate input and output: copy, then reduce in place in the output.
        copy_first = not spec.in_place and c in ("allreduce", "reduce") and out is not None
        target = out if out is not None else inp
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        call: Callable[[], Any]
        if c == "allreduce":
            call = lambda: dist.all_reduce(target, op=op)  # noqa: E731
        elif c == "reduce":
            call = lambda: dist.reduce(target, dst=root, op=op)  # noqa: E731
        elif c == "broadcast":
            call = lambda: dist.broadcast(out, src=root)  # noqa: E731
        elif c == "reduce_scatter":
            call = lambda: reduce_scatter(out, inp, op=op)  # noqa: E731
        elif c == "allgather":
            call = lambda: all_gather(out, inp)  # noqa: E731
        elif c == "alltoall":
            call = lambda: dist.all_to_all_single(out, inp)  # noqa: E731
        elif c == "gather":
            parts = list(out.view(size, k).unbind(0)) if is_root else None
            call = lambda: dist.gather(inp, gather_list=parts, dst=root)  # noqa: E731
        elif c == "scatter":
            parts = list(inp.view(size, k).unbind(0)) if is_root else None
            call = lambda: dist.scatter(out, scatter_list=parts, src=root)  # noqa: E731
        elif c == "barrier":
            call = dist.barrier
        else:
            raise ValueError(f"unknown collective {c!r}")
        if copy_first:
            inner, source = call, inp

            def call() -> None:
                target.copy_(source)
                inner()

        return Prepared(call, "gloo", bufs.out)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` everywhere."""
        t = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.broadcast(t, src=0)
        return int(t.item())

    def gather_rows(self, row: np.ndarray) -> np.ndarray | None:
        """Every rank's ``row`` stacked on rank 0."""
        t = self.torch.from_numpy(np.ascontiguousarray(row, np.float64))
        parts = [self.torch.empty_like(t) for _ in range(self.size)]
        self.dist.all_gather(parts, t)
        return self.torch.stack(parts).numpy() if self.rank == 0 else None


def _make(spec: SweepSpec) -> tuple[GlooBackend, dict[str, Any], Callable[[], None]]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise Unsupported(f"torch cannot be imported: {exc}") from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise Unsupported("this torch build has no gloo backend")
    rank, size = int(os.environ["PLAIT_RANK"]), int(os.environ["PLAIT_SIZE"])
    port = int(spec.options["port"])
    timeout = datetime.timedelta(seconds=float(spec.options.get("timeout", 300)))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timeout,
    )
    info = {"torch": torch.__version__}
    return GlooBackend(torch, dist), info, dist.destroy_process_group


def main() -> None:
    """Run the sweep named on the command line on this rank."""
    worker_main(_make)


if __name__ == "__main__":
    main()
