"""Gradient bucketing: reduce gradients in fused buckets while backward still runs.

Data-parallel training spends its communication on many small gradient
arrays. Reducing each alone pays the per-call latency every time; reducing
them all after backward leaves the network idle while computing and the CPU
idle while communicating. A :class:`Bucketer` does what PyTorch's DDP reducer
and Horovod's tensor fusion do: it packs gradients into buckets of about
``bucket_bytes`` (25 MiB by default, DDP's default) in the order backward
produces them, and starts each bucket's allreduce (``async_op=True``) as soon
as its last gradient is in, so the reduction of the last layers overlaps the
backward pass of the first ones. :meth:`Bucketer.wait` then writes the
averaged gradients back where they came from.

::

    grads = [np.empty_like(p) for p in params]            # where backward writes
    bucketer = Bucketer(comm, grads)
    for step in range(steps):
        for i in reversed(range(len(params))):            # backward, last layer first
            grads[i][...] = backward_of_layer(i)
            bucketer.ready(i)                              # may start a bucket's allreduce
        bucketer.wait()                                    # grads now hold the averages
        ...                                                # optimizer step

Every rank must build its Bucketer from the same list of (shape, dtype) and
mark the same gradients ready each step; buckets are always started in the
same order (a bucket that fills early waits for the ones before it), so ranks
whose backward orders differ still agree. The bucket buffers are allocated
once and reused every step.

For torch modules, :func:`attach` registers a hook on every parameter that
hands its gradient to a Bucketer as soon as it is accumulated.

Note [writing the averages back]
    A gradient is read and written through the communicator's own view of
    it (:func:`plait._checks.as_writable`): a numpy array as it is, a torch
    CPU tensor over its memory (bfloat16 too, as ml_dtypes' bfloat16), an
    array in device memory through a host copy that :meth:`Bucketer.wait`
    copies back (Note [staging through the host] in :mod:`plait._arrays`).
    :meth:`Bucketer.wait` writes each average through an array of the
    gradient's own shape (``out[...] = flat.reshape(out.shape)``), never
    through ``out.reshape(-1)``, which is a copy for a non-contiguous
    gradient (a transposed array, a channels-last convolution's
    ``weight.grad``): the average would land in the copy and each rank keep
    its own gradient. What cannot take the average in place is refused when
    the gradient is given, before any bucket starts: a JAX array (JAX never
    changes one), a list or another object only a copy of which could be
    written, a read-only array, and one whose elements share memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from plait import _arrays, _tensor
from plait._checks import as_writable, check_own_memory
from plait.errors import CommTimeout
from plait.ops import AVG, SUM, Op
from plait.runtime.work import Work

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucketer", "attach"]

#: Bucket size by default: 25 MiB, as DDP's ``bucket_cap_mb``.
DEFAULT_BUCKET_BYTES = 25 << 20


class _Bucket:
    __slots__ = ("buffer", "members", "offsets", "pending", "work")

    def __init__(self, members: list[int], offsets: list[int], buffer: np.ndarray) -> None:
        self.members = members  # gradient indexes, in packing order
        self.offsets = offsets  # element offset of each member in buffer
        self.buffer = buffer
        self.pending = len(members)  # members not yet ready this step
        self.work: Work | None = None


class Bucketer:
    """Allreduce many gradients in fused buckets, each started as soon as it is complete.

    Args:
        comm: the communicator (every rank calls with the same layout).
        grads: the gradients' arrays, or (shape, dtype) pairs when the arrays
            are given to :meth:`ready` each step (torch recreates ``.grad``).
        bucket_bytes: target bytes per bucket; a gradient larger than this
            gets a bucket of its own.
        op: the reduction (``plait.AVG`` by default: averaged gradients).
        order: gradient indexes in the order backward produces them
            (default: last to first, as backward visits layers).
        compression: passed to each bucket's allreduce, if given.

    Raises:
        ValueError: an empty layout or a non-positive ``bucket_bytes``, or a
            gradient the average cannot be written into (read-only, or
            elements that share memory).
        TypeError: a gradient that cannot be changed in place (a JAX array,
            a list; Note [writing the averages back]) or whose dtype plait
            cannot move.
    """

    def __init__(
        self,
        comm: Any,
        grads: Sequence[np.ndarray | tuple[tuple[int, ...], Any]],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        op: Op = AVG,
        order: Sequence[int] | None = None,
        compression: Any = None,
    ) -> None:
        if not grads:
            raise ValueError("Bucketer needs at least one gradient")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm = comm
        self.op = op
        self.compression = compression
        layout: list[tuple[tuple[int, ...], np.dtype]] = []
        # The caller's gradients, read again at each ready(): an array in device memory
        # holds new contents every step, which a host copy made here would not.
        self._arrays: list[Any] = []
        for i, g in enumerate(grads):
            if isinstance(g, tuple):
                shape, dtype = g
                layout.append((tuple(shape), _layout_dtype(dtype, i)))
                self._arrays.append(None)
            else:
                a, _ = self._writable(g, i, "Bucketer")
                layout.append((a.shape, a.dtype))
                self._arrays.append(g)
        self._layout = layout
        if compression is not None:
            _check_compressible(layout, op)
        n = len(layout)
        order = list(range(n - 1, -1, -1)) if order is None else list(order)
        if sorted(order) != list(range(n)):
            raise ValueError(f"order must list every gradient index 0..{n - 1} exactly once")
        # Consecutive gradients of one dtype, in backward order, up to bucket_bytes each.
        self._buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * n  # grad -> (bucket, member index)
        group: list[int] = []
        nbytes = 0
        for i in order:
            shape, dtype = layout[i]
            size = int(np.prod(shape)) * dtype.itemsize
            if group and (layout[group[0]][1] != dtype or nbytes + size > bucket_bytes):
                self._add_bucket(group)
                group, nbytes = [], 0
            group.append(i)
            nbytes += size
        self._add_bucket(group)
        self._outs: list[Any] = [None] * n  # where each result goes this step
        self._next = 0  # next bucket to start (buckets start in order)

    def _add_bucket(self, members: list[int]) -> None:
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += int(np.prod(self._layout[i][0]))
        k = len(self._buckets)
        for j, i in enumerate(members):
            self._where[i] = (k, j)
        dtype = self._layout[members[0]][1]
        self._buckets.append(_Bucket(members, offsets, np.zeros(total, dtype)))

    @property
    def num_buckets(self) -> int:
        """How many buckets the gradients were packed into."""
        return len(self._buckets)

    def bucket_members(self) -> list[list[int]]:
        """The gradient indexes of each bucket, in the order buckets start."""
        return [list(b.members) for b in self._buckets]

    def ready(self, index: int, grad: Any = None) -> None:
        """Gradient ``index`` is final for this step: pack it; maybe start buckets.

        Args:
            index: the gradient's position in the ``grads`` given at construction.
            grad: its array this step (a numpy array, a torch tensor, any
                array whose memory can be written in place), required when
                the Bucketer was built from (shape, dtype) pairs; the reduced
                result is written back into it by :meth:`wait`.

        Raises:
            ValueError: ``index`` was already marked this step, or ``grad``
                has the wrong shape or dtype or is missing, or is read-only.
            TypeError: ``grad`` cannot be changed in place (a JAX array, a
                list; Note [writing the averages back]).
        """
        if not 0 <= index < len(self._layout):
            raise ValueError(f"gradient index {index} out of range 0..{len(self._layout) - 1}")
        if self._outs[index] is not None:
            raise ValueError(
                f"gradient {index} was already marked ready this step; wait() ends a step "
                "(after a wait() that timed out, the step goes on until a wait() finishes it)"
            )
        given = self._arrays[index] if grad is None else grad
        if given is None:
            raise ValueError(f"gradient {index}: pass its array (the Bucketer has only its shape)")
        target, out = self._writable(given, index, "Bucketer.ready")
        shape, dtype = self._layout[index]
        if target.shape != shape or target.dtype != dtype:
            raise ValueError(
                f"gradient {index} has shape {target.shape} and dtype {target.dtype}; "
                f"expected {shape} and {dtype}"
            )
        k, j = self._where[index]
        bucket = self._buckets[k]
        start = bucket.offsets[j]
        bucket.buffer[start : start + target.size] = target.reshape(-1)  # only read: a copy serves
        self._outs[index] = out
        bucket.pending -= 1
        self._start_ready_buckets()

    def _writable(self, grad: Any, index: int, c: str) -> tuple[np.ndarray, Any]:
        """``grad`` as an array to pack from, and where :meth:`wait` writes its average.

        The two are one array, except for an array in device memory: its host
        copy, and a :class:`plait._arrays.DeviceTarget` that copies the average
        back. See Note [writing the averages back] for what is refused.
        """
        rank, what = self.comm.rank, f"gradient {index}"
        if _arrays.immutable(grad):
            kind = "jax.Array" if _arrays.is_jax(grad) else type(grad).__name__
            raise TypeError(
                f"rank {rank}: {c}: {what} is a {kind}, which cannot be changed in place, so "
                "the Bucketer cannot write the reduced result into it; pass a numpy array "
                "(np.array(grad)) and convert it after wait()"
            )
        a = as_writable(grad, what, rank, c)
        if not a.flags.writeable:
            raise ValueError(
                f"rank {rank}: {c}: {what} is read-only, so the Bucketer cannot write the "
                "reduced result into it"
            )
        if not a.flags.c_contiguous:
            check_own_memory(a, what, rank, c)
        back = _arrays.target(grad, a)
        return a, (a if back is None else back)

    def _start_ready_buckets(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            b = self._buckets[self._next]
            kwargs = {} if self.compression is None else {"compression": self.compression}
            try:
                b.work = self.comm.allreduce(
                    b.buffer, self.op, out=b.buffer, async_op=True, **kwargs
                )
            except BaseException:
                # The step cannot finish: the buckets started finish on every rank, and the
                # next ready() begins a new step (not this bucket again, for another gradient).
                self._abandon()
                raise
            self._next += 1

    def wait(self, timeout: float | None = None) -> None:
        """Finish every bucket and write the results into the gradients; ready for a new step.

        ``timeout`` bounds the wait for each bucket. Where it passes first, the
        allreduces go on, nothing is reset, and a later :meth:`wait` finishes the
        step (gradients already written are written again with the same values).

        Raises:
            ValueError: some gradients were never marked ready this step (their
                indexes are named); nothing was started for their buckets.
            CommTimeout: ``timeout`` passed first (the step goes on: call wait again).
            CommError: a bucket's allreduce failed.
        """
        missing = [i for i, out in enumerate(self._outs) if out is None]
        if missing:
            self._abandon()
            raise ValueError(f"gradients {missing} were not marked ready before wait()")
        running = False  # a bucket's allreduce goes on: its buffer is not ours to reuse yet
        try:
            for b in self._buckets:
                assert b.work is not None  # every gradient ready: every bucket started
                try:
                    b.work.wait(timeout)
                except CommTimeout:
                    running = not b.work.done()  # else the allreduce itself timed out
                    raise
                for i, start in zip(b.members, b.offsets, strict=True):
                    # Through an array of the gradient's shape, never out.reshape(-1)
                    # (Note [writing the averages back]).
                    shape = self._layout[i][0]
                    self._outs[i][...] = b.buffer[start : start + math.prod(shape)].reshape(shape)
        finally:
            if not running:  # done, or failed: a new step begins
                self._reset()

    def _abandon(self) -> None:
        for b in self._buckets:
            if b.work is not None:
                b.work.wait()  # collectives already started must finish on every rank
        self._reset()

    def _reset(self) -> None:
        for b in self._buckets:
            b.pending = len(b.members)
            b.work = None
        self._outs = [None] * len(self._layout)
        self._next = 0


def attach(
    module: Any,
    comm: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    op: Op = AVG,
    compression: Any = None,
) -> Callable[[], None]:
    """Average a torch module's gradients over ``comm`` while its backward runs.

    Registers a post-accumulate-grad hook on every parameter that requires a
    gradient (torch >= 2.1); each hook hands the gradient to a
    :class:`Bucketer` at once. Call the returned function after
    ``loss.backward()`` and before ``optimizer.step()``: it waits for the
    buckets and writes the averages into every ``param.grad``.

    Every parameter must receive a gradient in every step (as with DDP's
    default ``find_unused_parameters=False``); the function raises
    ValueError naming those that did not.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no parameters that require a gradient")
    layout = [
        (tuple(p.shape), _torch_dtype(p.dtype, f"attach: parameter {i} ({tuple(p.shape)})"))
        for i, p in enumerate(params)
    ]
    bucketer = Bucketer(comm, layout, bucket_bytes=bucket_bytes, op=op, compression=compression)
    for i, p in enumerate(params):

        def hook(param: Any, i: int = i) -> None:
            bucketer.ready(i, param.grad.detach())

        p.register_post_accumulate_grad_hook(hook)
    return bucketer.wait


def _torch_dtype(dtype: Any, what: str) -> np.dtype:
    """The numpy dtype plait reads tensors of torch's ``dtype`` as (ml_dtypes' for bfloat16).

    Raises:
        TypeError: a dtype plait cannot move (the message names ``what``).
    """
    import torch

    return np.dtype(_tensor.as_array(torch.empty(0, dtype=dtype), what).dtype)


def _layout_dtype(dtype: Any, index: int) -> np.dtype:
    """The numpy dtype of a (shape, dtype) pair's ``dtype``: numpy's, or torch's (as
    :func:`attach` reads a parameter's gradients)."""
    if type(dtype).__module__ == "torch":
        return _torch_dtype(dtype, f"Bucketer: gradient {index}")
    try:
        found: np.dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"Bucketer: gradient {index}: {dtype!r} is not a dtype; pass a numpy or torch "
            "dtype (np.float32, torch.float32)"
        ) from None
    return found


def _check_compressible(layout: Sequence[tuple[tuple[int, ...], np.dtype]], op: Op) -> None:
    """Refuse at construction what a compressed allreduce of a bucket would refuse at its
    start, mid-step: a gradient that is not floating point, or an op but SUM and AVG."""
    for i, (_, dtype) in enumerate(layout):
        if dtype not in _COMPRESSIBLE:
            raise TypeError(
                f"Bucketer: gradient {i} is {dtype}; compression needs float16, float32 or "
                "float64 gradients (reduce the others with a Bucketer of their own)"
            )
    if op not in (SUM, AVG):
        raise ValueError(f"Bucketer: compression supports plait.SUM and plait.AVG; got {op!r}")


_COMPRESSIBLE = frozenset(np.dtype(t) for t in (np.float16, np.float32, np.float64))
