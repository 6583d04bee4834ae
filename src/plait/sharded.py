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

import zlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plait import _arrays, _tensor
from plait._checks import as_array, as_writable, check_count, check_out
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
        # Every rank's n first (one small allgather, -1 for one refused here): ranks that
        # differ would make different numbers of splits, and those with more wait in the
        # last one until the timeout; a rank that raised alone would leave them waiting too.
        refused = None
        try:
            n = check_count(n, 1, "n", comm.rank, "Channels")
        except (TypeError, ValueError) as exc:
            refused, n = exc, -1
        ns = [int(k) for k in comm.allgather(np.array([n], np.int64)).reshape(-1)]
        if refused is not None:
            raise refused
        if len(set(ns)) > 1:
            raise ValueError(
                f"rank {comm.rank}: Channels: the ranks ask for different numbers of "
                f"channels, {ns} by rank (-1: refused there); every rank must pass the same n"
            )
        self.comm = comm
        self.channels = [comm.split(0, comm.rank) for _ in range(n)]

    def allreduce(self, x: Any, op: Op = SUM, *, out: Any = None) -> Any:
        """``comm.allreduce(x, op, out=out)``, the shards reduced concurrently on the channels.

        ``x`` and ``out`` are what the communicator takes, and the result is
        of the kind it returns: ``out`` if given, else a new array of ``x``'s
        kind (a torch tensor for a tensor, a ``jax.Array`` for a JAX array, a
        numpy array otherwise). The result is identical on every rank (each
        shard is one ordinary allreduce); it may differ in the last bits from
        an unsharded call, whose algorithm may associate the sums differently.

        Raises:
            ValueError: ``out`` has another shape than ``x``, or is read-only.
            TypeError: ``out`` has another dtype, or cannot be written in place.
        """
        rank, c = self.comm.rank, "Channels.allreduce"
        a = as_array(x, "x", rank, c)
        o = check_out(out, a.shape, a.dtype, rank, c)
        # Staged out (device memory): its host buffer, copied back once the shards are done.
        back = _arrays.target(out, o) if o is not None and o is not out else None
        flat_in = np.ascontiguousarray(a).reshape(-1)
        result = np.empty(a.shape, a.dtype) if o is None else o
        contiguous = result.flags.c_contiguous and result.dtype == a.dtype
        target = result if contiguous else np.empty(a.shape, a.dtype)
        flat_out = target.reshape(-1)  # a view: target is contiguous
        if (
            flat_in.size
            and np.may_share_memory(flat_in, flat_out)
            and not (flat_in.ctypes.data == flat_out.ctypes.data and flat_in.size == flat_out.size)
        ):
            # out overlaps x partly: a shard written would be another shard's input, read
            # meanwhile on its channel (the communicator copies x so too)
            flat_in = flat_in.copy()
        bounds = np.linspace(0, flat_in.size, len(self.channels) + 1).astype(int)
        works: list[Work] = []
        for ch, lo, hi in zip(self.channels, bounds[:-1], bounds[1:], strict=True):
            works.append(ch.allreduce(flat_in[lo:hi], op, out=flat_out[lo:hi], async_op=True))
        for w in works:
            w.wait()
        if target is not result:
            result[...] = target
        if o is not None:
            if back is not None:
                back[...] = o
            return out  # the caller's object, as the communicator returns it
        return _in_kind(x, a, result)

    def close(self) -> None:
        """Release the channels (the parent communicator stays open)."""
        for ch in self.channels:
            ch.close()

    def __enter__(self) -> Channels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_kind(x: Any, a: np.ndarray, result: np.ndarray) -> Any:
    """A new ``result`` in the kind of the caller's ``x`` (read as ``a``), as the
    communicator makes it (Note [result types] in plait.communicator): the array itself, a
    tensor over it, or JAX's / the device's."""
    if a is x:
        return result
    finish = _arrays.finisher(x)
    return finish(result) if finish is not None else _tensor.like(x, result)


#: update(param_shard, grad_shard, state) -> None, in place; ``state`` is a dict kept per rank.
Update = Callable[[np.ndarray, np.ndarray, dict[str, Any]], None]


class ShardedOptimizer:
    """ZeRO-style data parallelism: each rank updates only its shard of the parameters.

    Args:
        comm: the communicator.
        params: the model's parameters (one dtype), updated in place by :meth:`step`:
            numpy arrays or torch CPU tensors (``nn.Parameter`` included, written through
            its data as a torch optimizer writes it); anything else plait writes in place
            (:func:`plait._checks.as_writable`), but not memory on a device or read-only.
        update: the optimizer rule applied to one shard, in place:
            ``update(param_shard, grad_shard, state)`` with 1-D views; ``state``
            is this rank's dict, so momentum or Adam moments cover the shard only.

    Every rank must pass the same parameter shapes. Each step reads this
    rank's shard from the parameters as they are then, so changes made to
    them between steps (a checkpoint loaded, a manual reset; the same on
    every rank) are kept, not overwritten by the shard of the step before.
    """

    def __init__(self, comm: Any, params: Sequence[Any], update: Update) -> None:
        if isinstance(params, np.ndarray) or _tensor.is_tensor(params):
            raise TypeError(
                f"rank {comm.rank}: ShardedOptimizer: params must be a sequence of "
                "parameters (a list, or model.parameters()); got one array: pass [params]"
            )
        self._sources = list(params)  # the caller's, read again each step (_current)
        if not self._sources:
            raise ValueError("ShardedOptimizer needs at least one parameter")
        self.comm = comm
        self.params = [_param(comm.rank, p, f"params[{i}]") for i, p in enumerate(self._sources)]
        self._ptrs = [_address(p) for p in self._sources]
        self._checked = False  # every rank's shapes compared, at the first step
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters must share one dtype, got {sorted(map(str, dtypes))}")
        params = self.params
        self.update = update
        self.state: dict[str, Any] = {}
        total = sum(p.size for p in params)
        self.shard = -(-total // comm.size)  # ceil: the last shard is padded
        dtype = params[0].dtype
        self._flat = np.zeros(self.shard * comm.size, dtype)
        self._grad_shard = np.empty(self.shard, dtype)
        self._param_shard = np.zeros(self.shard, dtype)  # the last one's padding stays 0
        self._total = total

    def _pack(self, arrays: Sequence[np.ndarray]) -> None:
        at = 0
        for a in arrays:
            self._flat[at : at + a.size] = a.reshape(-1)
            at += a.size

    def _load_shard(self) -> None:
        """Copy this rank's shard of the parameters, as they are now, into ``_param_shard``."""
        lo = self.comm.rank * self.shard
        hi = lo + self.shard
        at = 0
        for p in self.params:
            start, stop = max(lo, at), min(hi, at + p.size)
            if start < stop:  # only read: reshape(-1) may be a copy
                self._param_shard[start - lo : stop - lo] = p.reshape(-1)[start - at : stop - at]
            at += p.size

    def step(self, grads: Sequence[Any]) -> None:
        """Average ``grads`` over ranks, update this rank's shard, share the new parameters.

        ``grads``: one array per parameter, of its shape (numpy arrays or tensors, as
        the communicator takes them).
        """
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")
        r, c = self.comm.rank, "ShardedOptimizer.step"
        self._current()
        grads = [as_array(g, f"grads[{i}]", r, c) for i, g in enumerate(grads)]
        for g, p in zip(grads, self.params, strict=True):
            if g.shape != p.shape:
                raise ValueError(f"a gradient has shape {g.shape}; its parameter has {p.shape}")
        if not self._checked:
            self._same_shapes()
        self._pack(grads)
        self._flat[self._total :] = 0
        rows = self._flat.reshape(self.comm.size, self.shard)
        self.comm.reduce_scatter(rows, AVG, out=self._grad_shard.reshape(1, self.shard))
        self._load_shard()
        self.update(self._param_shard, self._grad_shard, self.state)
        gathered = self.comm.allgather(self._param_shard)
        flat = gathered.reshape(-1)
        at = 0
        for p in self.params:
            # Through p's own shape: p.reshape(-1) is a copy when p is not contiguous (a
            # transposed array), and the new values would never reach p.
            p[...] = flat[at : at + p.size].reshape(p.shape)
            at += p.size

    def _current(self) -> None:
        """Read again each torch parameter whose memory was replaced since (``p.data = ...``,
        as ``vector_to_parameters`` or a checkpoint loader does): a torch optimizer reads
        ``p.data`` at every step, and this one wrote the old memory, which nothing used."""
        for i, p in enumerate(self._sources):
            at = _address(p)
            if at != self._ptrs[i]:
                a = _param(self.comm.rank, p, f"params[{i}]")
                if a.shape != self.params[i].shape or a.dtype != self.params[i].dtype:
                    raise ValueError(
                        f"rank {self.comm.rank}: ShardedOptimizer: params[{i}] is now "
                        f"{a.shape} of {a.dtype}; it was {self.params[i].shape} of "
                        f"{self.params[i].dtype} (make a new optimizer for new shapes)"
                    )
                self.params[i], self._ptrs[i] = a, at

    def _same_shapes(self) -> None:
        """Compare every rank's parameter shapes (one small allgather, at the first step):
        ranks whose totals pad to the same shard would otherwise exchange shards of
        different parameters, and their replicas drift apart without an error."""
        shapes = repr([tuple(p.shape) for p in self.params]).encode()
        mine = np.array([self._total, len(self.params), zlib.crc32(shapes)], np.int64)
        table = self.comm.allgather(mine)
        differ = [q for q in range(self.comm.size) if not np.array_equal(table[q], table[0])]
        if differ:
            raise ValueError(
                f"rank {self.comm.rank}: ShardedOptimizer.step: the parameter shapes of "
                f"rank(s) {differ} differ from rank 0's (totals by rank "
                f"{table[:, 0].tolist()}, counts {table[:, 1].tolist()}); every rank must "
                "pass the same parameter shapes; nothing was updated"
            )
        self._checked = True


def _address(p: Any) -> int:
    """Where a torch parameter's data starts now (0 for an array: its memory stays)."""
    return int(p.data_ptr()) if _tensor.is_tensor(p) else 0


def _param(rank: int, p: Any, what: str) -> np.ndarray:
    """Parameter ``p`` as a numpy array over its own memory, which :meth:`ShardedOptimizer.step`
    updates in place."""
    c = "ShardedOptimizer"
    if _arrays.staged(p):  # a host copy would take the update, never the device's memory
        raise TypeError(
            f"rank {rank}: {c}: {what} is in device memory; ShardedOptimizer updates "
            "parameters in host memory only (numpy arrays, CPU tensors)"
        )
    if _tensor.is_tensor(p):
        p = p.detach()  # the same memory: step writes it as an optimizer does, without grad
    a = as_writable(p, what, rank, c)
    if not a.flags.writeable:
        raise ValueError(f"rank {rank}: {c}: {what} is read-only; step writes it in place")
    return a


class StaleAverager:
    """Average gradients in the background; apply each average ``staleness`` steps later.

    ``average(grad)`` starts the average of this step's ``grad`` (copied, so
    the caller may reuse its array) and returns the average that is due now:
    the one started ``staleness`` calls earlier, or None during the first
    ``staleness`` calls. :meth:`drain` returns the averages still in flight.
    """

    def __init__(self, comm: Any, staleness: int = 1) -> None:
        staleness = check_count(staleness, 0, "staleness", comm.rank, "StaleAverager")
        self.comm = comm
        self.staleness = staleness
        # (the work, the grad it averages, that grad as read): the result takes its kind
        self._pending: deque[tuple[Work, Any, np.ndarray]] = deque()

    def average(self, grad: Any) -> Any:
        """Start averaging ``grad``; return the average due at this step, if any.

        ``grad``: an array the communicator takes (a numpy array, a torch tensor of any
        dtype it moves, bfloat16 included); each average comes back in the kind of the
        ``grad`` it was started from, as a new array (a tensor for a tensor).
        """
        a = as_array(grad, "grad", self.comm.rank, "StaleAverager.average")
        buf = np.array(a, copy=True)
        work = self.comm.allreduce(buf, AVG, out=buf, async_op=True)
        self._pending.append((work, grad, a))
        if len(self._pending) > self.staleness:
            return self._due(*self._pending.popleft())
        return None

    def drain(self) -> list[Any]:
        """Wait for every average still in flight, oldest first."""
        out = [self._due(*pending) for pending in self._pending]
        self._pending.clear()
        return out

    @staticmethod
    def _due(work: Work, grad: Any, a: np.ndarray) -> Any:
        """The average ``work`` makes, in ``grad``'s kind (``a``: grad as read)."""
        buf: np.ndarray = work.wait()
        return _in_kind(grad, a, buf)
