"""Sharded and asynchronous all-reduce for data-parallel training.

Three tools on top of the communicator's collectives:

- :class:`Channels`: a large array cut into shards that are reduced at the
  same time, each on its own channel (a sub-communicator with its own
  background thread), so one shard's reduction overlaps another's transfer.
- :class:`ShardedOptimizer`: the ZeRO pattern (Rajbhandari et al. 2020,
  stage 1/2): ``reduce_scatter`` the gradients so each rank gets the average
  of its shard only, update that shard of the parameters (and keep optimizer
  state for it alone: 1/size of the memory), then ``allgather`` the updated
  shards. It trains exactly like averaging every gradient and updating every
  parameter on every rank, with a fraction of the optimizer memory.
- :class:`StaleAverager`: bounded staleness. Step ``t`` starts the average of
  its gradients in the background and applies the average of step
  ``t - s`` (waiting only if that one is not done yet), so computation never
  waits on communication for up to ``s`` steps of latency; ``s = 0`` is the
  synchronous average. Every rank applies the same averages in the same
  order, so replicas stay identical.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plait.ops import AVG, SUM, Op
from plait.runtime.work import Work

__all__ = ["Channels", "ShardedOptimizer", "StaleAverager"]


class Channels:
    """``n`` independent channels over one communicator, for sharded reductions.

    Made collectively: every rank must create its Channels at the same point
    of its program (each channel is a ``comm.split``). Close them before the
    communicator (or use ``with``).
    """

    def __init__(self, comm: Any, n: int = 4) -> None:
        if n < 1:
            raise ValueError(f"need at least one channel, got {n}")
        self.comm = comm
        self.channels = [comm.split(0, comm.rank) for _ in range(n)]

    def allreduce(self, x: np.ndarray, op: Op = SUM, *, out: np.ndarray | None = None) -> Any:
        """``comm.allreduce(x, op, out=out)``, the shards reduced concurrently on the channels.

        The result is identical on every rank (each shard is one ordinary
        allreduce); it may differ in the last bits from an unsharded call,
        whose algorithm may associate the sums differently.
        """
        a = np.ascontiguousarray(x)
        result = np.empty_like(a) if out is None else out
        if result.shape != a.shape or result.dtype != a.dtype:
            raise ValueError(
                f"out has shape {result.shape} and dtype {result.dtype}; "
                f"expected {a.shape} and {a.dtype}"
            )
        target = result if result.flags.c_contiguous else np.empty_like(a)
        flat_in, flat_out = a.reshape(-1), target.reshape(-1)
        bounds = np.linspace(0, flat_in.size, len(self.channels) + 1).astype(int)
        works: list[Work] = []
        for ch, lo, hi in zip(self.channels, bounds[:-1], bounds[1:], strict=True):
            works.append(ch.allreduce(flat_in[lo:hi], op, out=flat_out[lo:hi], async_op=True))
        for w in works:
            w.wait()
        if target is not result:
            result[...] = target
        return result

    def close(self) -> None:
        """Release the channels (the parent communicator stays open)."""
        for ch in self.channels:
            ch.close()

    def __enter__(self) -> Channels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: update(param_shard, grad_shard, state) -> None, in place; ``state`` is a dict kept per rank.
Update = Callable[[np.ndarray, np.ndarray, dict[str, Any]], None]


class ShardedOptimizer:
    """ZeRO-style data parallelism: each rank updates only its shard of the parameters.

    Args:
        comm: the communicator.
        params: the model's parameter arrays (one dtype), updated in place by :meth:`step`.
        update: the optimizer rule applied to one shard, in place:
            ``update(param_shard, grad_shard, state)`` with 1-D views; ``state``
            is this rank's dict, so momentum or Adam moments cover the shard only.

    Every rank must pass the same parameter shapes.
    """

    def __init__(self, comm: Any, params: Sequence[np.ndarray], update: Update) -> None:
        if not params:
            raise ValueError("ShardedOptimizer needs at least one parameter")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.comm = comm
        self.params = list(params)
        self.update = update
        self.state: dict[str, Any] = {}
        total = sum(p.size for p in params)
        self.shard = -(-total // comm.size)  # ceil: the last shard is padded
        dtype = params[0].dtype
        self._flat = np.zeros(self.shard * comm.size, dtype)
        self._grad_shard = np.empty(self.shard, dtype)
        self._param_shard = np.empty(self.shard, dtype)
        self._total = total
        lo = comm.rank * self.shard
        self._pack(self.params)
        self._param_shard[...] = self._flat[lo : lo + self.shard]

    def _pack(self, arrays: Sequence[np.ndarray]) -> None:
        at = 0
        for a in arrays:
            self._flat[at : at + a.size] = a.reshape(-1)
            at += a.size

    def step(self, grads: Sequence[np.ndarray]) -> None:
        """Average ``grads`` over ranks, update this rank's shard, share the new parameters."""
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        for g, p in zip(grads, self.params, strict=True):
            if g.shape != p.shape:
                raise ValueError(f"a gradient has shape {g.shape}; its parameter has {p.shape}")
        self._pack(grads)
        self._flat[self._total :] = 0
        rows = self._flat.reshape(self.comm.size, self.shard)
        self.comm.reduce_scatter(rows, AVG, out=self._grad_shard.reshape(1, self.shard))
        self.update(self._param_shard, self._grad_shard, self.state)
        gathered = self.comm.allgather(self._param_shard)
        flat = gathered.reshape(-1)
        at = 0
        for p in self.params:
            p.reshape(-1)[...] = flat[at : at + p.size]
            at += p.size


class StaleAverager:
    """Average gradients in the background; apply each average ``staleness`` steps later.

    ``average(grad)`` starts the average of this step's ``grad`` (copied, so
    the caller may reuse its array) and returns the average that is due now:
    the one started ``staleness`` calls earlier, or None during the first
    ``staleness`` calls. :meth:`drain` returns the averages still in flight.
    """

    def __init__(self, comm: Any, staleness: int = 1) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.comm = comm
        self.staleness = staleness
        self._pending: deque[Work] = deque()

    def average(self, grad: np.ndarray) -> np.ndarray | None:
        """Start averaging ``grad``; return the average due at this step, if any."""
        buf = np.array(grad, copy=True)
        self._pending.append(self.comm.allreduce(buf, AVG, out=buf, async_op=True))
        if len(self._pending) > self.staleness:
            due: np.ndarray = self._pending.popleft().wait()
            return due
        return None

    def drain(self) -> list[np.ndarray]:
        """Wait for every average still in flight, oldest first."""
        out = [w.wait() for w in self._pending]
        self._pending.clear()
        return out
