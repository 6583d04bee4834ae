"""Gradient bucketing: reduce gradients in fused buckets while backward still runs.

Data-parallel training spends its communication on many small gradient
arrays. Reducing each alone pays the per-call latency every time; reducing
them all after backward leaves the network idle while computing and the CPU
idle while communicating. A :class:`Bucketer` does what PyTorch's DDP reducer
and Horovod's tensor fusion do: it packs gradients into buckets of about
``bucket_bytes`` (25 MiB by default, DDP's default) in the order backward
produces them, one bucket of each dtype open at a time (Note [a bucket per
dtype] in :mod:`plait._bucket_layout`), and starts each bucket's allreduce
(``async_op=True``) as soon as its last gradient is in, so the reduction of
the last layers overlaps the backward pass of the first ones.
:meth:`Bucketer.wait` then writes the averaged gradients back where they
came from.

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
hands its gradient to a Bucketer as soon as it is accumulated; what it
returns ends a step when called, and its ``no_sync()`` accumulates gradients
over several backward passes (Note [a step under attach]).

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

Note [what a failed step leaves]
    :meth:`Bucketer.wait` writes each bucket's results back as soon as its
    allreduce has finished, while later buckets are still reduced. Where a
    bucket fails (a MismatchError: one gradient float32 on one rank and
    float64 on another), the buckets before it are written back and it and
    the later ones are not, and the error said only that "the output
    buffer's contents are undefined", which is the bucket's own. So the
    error names both sets: the gradients that hold the step's results and
    those that hold this rank's own values; none is undefined, since a
    gradient is written only from a bucket that finished. Writing back
    only once every bucket has finished would leave every gradient as it
    was, but it takes the write-back of all buckets but the last from
    behind the reduction of the later ones to the end of every step: a
    copy of nearly every gradient byte in series, measured in
    docs/training.md, to serve a step that failed, after which the
    communicator is broken anyway.

Note [PowerSGD in buckets]
    PowerSGD compresses a gradient as a matrix (axis 0 by the rest); a
    bucket's flat buffer is 1-D, and PowerSGD sends a 1-D array whole, so
    compressing the buffer would send every byte. With PowerSGD (or a
    ``with_key`` of it) each gradient it would compress gets a buffer of its
    own shape, reduced by a compressed allreduce of its own when its bucket
    starts; the bucket's other gradients (vectors, matrices too small to
    gain) share the flat buffer, reduced by a plain allreduce, which is what
    PowerSGD does with them anyway. This is how torch's PowerSGD hook treats
    a bucket. Each gradient's state (its ``Q``, its error) is keyed by its
    own buffer, which lives as long as the Bucketer, or, for a keyed
    compressor ``c.with_key(k)``, by ``(k, index)``. Other compressors work
    element by element and reduce the flat buffer as it is.

Note [keyed compressors in buckets]
    A keyed compressor ``c.with_key(k)`` keeps its state under one key, and
    a key's state holds one shape. Given to every bucket as it is, the
    buckets (of different sizes) shared one key, and the second bucket's
    allreduce was refused mid-step, after the first had started. So ``k``
    names the Bucketer: bucket ``b``'s buffer is keyed ``(k, "bucket", b)``
    and a gradient PowerSGD compresses on its own ``(k, index)``. An
    unkeyed compressor keys its state by the buffer's identity, which is
    one per bucket already.

Note [refused when built]
    Every rank calls ready() in backward, and the first complete bucket
    starts its allreduce at once; a gradient refused later in that step
    leaves the step half done. So what a bucket's allreduce would refuse is
    refused when the Bucketer is made, before any hook is registered: a
    dtype plait cannot move, an op that makes no sense for some gradient's
    dtype (AVG of integers), what compression cannot take, and a
    ``bucket_bytes`` or ``order`` that is not made of ints. :func:`attach`
    also refuses a module that will make sparse gradients (torch's
    ``nn.Embedding`` and ``nn.EmbeddingBag`` with ``sparse=True``): a bucket
    holds dense arrays, and the refusal would otherwise come in backward.

Note [a step under attach]
    A hook's error comes out of ``loss.backward()``, and nothing calls
    ``finish()`` for that step: the gradients handed over before it stayed
    marked, and every later backward failed in its first hook ("already
    marked ready"). So a hook whose gradient is refused drops the step: the
    allreduces it started finish (every rank started them), nothing is
    written back, and the next backward begins a new step. A second gradient
    for one parameter within a step is what two backward passes before one
    ``finish()`` give; as DDP does, it is refused, and the step dropped.
    Gradient accumulation is DDP's ``no_sync()``: inside it the hooks hand
    nothing over and gradients add up in ``.grad``; the first backward
    after it hands over their sums, and ``finish()`` ends the step. The one
    step not dropped is one a ``finish(timeout)`` left running: its
    allreduces go on and a later ``finish()`` writes their averages, so the
    error says to call ``finish()`` again. A sparse gradient that
    :func:`attach` could not foresee (``F.embedding(..., sparse=True)`` on a
    parameter of its own) is refused in its hook, which drops the step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from plait import _arrays
from plait._bucket_layout import assign, layout_pair, torch_dtype
from plait._checks import as_writable, check_own_memory
from plait._compressed import check_compression
from plait.compression.base import Keyed
from plait.compression.powersgd import PowerSGD
from plait.errors import CommError, CommTimeout
from plait.ops import AVG, SUM, Op
from plait.runtime.work import Work

__all__ = ["DEFAULT_BUCKET_BYTES", "Attached", "Bucketer", "attach"]

#: Bucket size by default: 25 MiB, as DDP's ``bucket_cap_mb``.
DEFAULT_BUCKET_BYTES = 25 << 20


class _Bucket:
    __slots__ = ("buffer", "compression", "members", "offsets", "own", "pending", "works")

    def __init__(
        self,
        members: list[int],
        offsets: dict[int, int],
        buffer: np.ndarray,
        compression: Any,
        own: dict[int, np.ndarray],
    ) -> None:
        self.members = members  # gradient indexes, in packing order
        self.offsets = offsets  # element offset in buffer of each member packed there
        self.buffer = buffer
        self.compression = compression  # the buffer's compressor, or None
        self.own = own  # members reduced on their own (Note [PowerSGD in buckets])
        self.pending = len(members)  # members not yet ready this step
        self.works: list[Work] = []  # this step's allreduces, once started


class Bucketer:
    """Allreduce many gradients in fused buckets, each started as soon as it is complete.

    Args:
        comm: the communicator (every rank calls with the same layout).
        grads: the gradients' arrays, or (shape, dtype) pairs when the arrays
            are given to :meth:`ready` each step (torch recreates ``.grad``).
        bucket_bytes: target bytes per bucket (an int); a gradient larger
            than this gets a bucket of its own.
        op: the reduction (``plait.AVG`` by default: averaged gradients); it
            must be defined for every gradient's dtype.
        order: gradient indexes in the order backward produces them
            (default: last to first, as backward visits layers).
        compression: passed to each bucket's allreduce, if given (float
            gradients, SUM or AVG). PowerSGD compresses each gradient as its
            own matrix (Note [PowerSGD in buckets]).

    Raises:
        ValueError: an empty layout, a ``bucket_bytes`` below 1, an ``order``
            that does not list every index once, or a gradient the average
            cannot be written into (read-only, or elements that share memory).
        TypeError: a gradient that cannot be changed in place (a JAX array,
            a list; Note [writing the averages back]), a dtype plait cannot
            move, an op not defined for some gradient's dtype, a gradient
            compression cannot take, or a ``bucket_bytes`` or ``order`` that
            is not made of ints (Note [refused when built]).
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
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int | np.integer):
            raise TypeError(
                f"Bucketer: bucket_bytes must be an int (bytes per bucket, such as 25 << 20); "
                f"got {bucket_bytes!r}"
            )
        if bucket_bytes <= 0:
            raise ValueError(f"Bucketer: bucket_bytes must be positive; got {bucket_bytes}")
        if not isinstance(op, Op):
            raise TypeError(f"Bucketer: op must be a plait.Op such as plait.AVG; got {op!r}")
        self.comm = comm
        self.op = op
        self.compression = compression
        layout: list[tuple[tuple[int, ...], np.dtype]] = []
        # The caller's gradients, read again at each ready(): an array in device memory
        # holds new contents every step, which a host copy made here would not.
        self._arrays: list[Any] = []
        for i, g in enumerate(grads):
            if isinstance(g, tuple):
                layout.append(layout_pair(g, i))
                self._arrays.append(None)
            else:
                a, _ = self._writable(g, i, "Bucketer")
                layout.append((a.shape, a.dtype))
                self._arrays.append(g)
        self._layout = layout
        for i, (_, dtype) in enumerate(layout):
            try:
                op.check(dtype)
            except TypeError as exc:
                raise TypeError(f"Bucketer: gradient {i}: {exc}") from None
        if compression is not None:
            check_compression(compression, "Bucketer")
            _check_compressible(layout, op)
        # The compressor of each gradient reduced on its own (Note [PowerSGD in buckets]).
        own = _own_compressors(compression, layout)
        self._own = {} if own is None else own
        self._flat_compression = compression if own is None else None
        n = len(layout)
        order = list(range(n - 1, -1, -1)) if order is None else list(order)
        if any(isinstance(i, bool) or not isinstance(i, int | np.integer) for i in order):
            raise TypeError(f"Bucketer: order must list gradient indexes (ints); got {order!r}")
        if sorted(order) != list(range(n)):
            raise ValueError(f"order must list every gradient index 0..{n - 1} exactly once")
        order = [int(i) for i in order]
        self._buckets: list[_Bucket] = []
        self._where: list[tuple[int, int]] = [(0, 0)] * n  # grad -> (bucket, member index)
        for members in assign(layout, order, bucket_bytes):
            self._add_bucket(members)
        self._outs: list[Any] = [None] * n  # where each result goes this step
        self._next = 0  # next bucket to start (buckets start in order)
        self._held = False  # a wait() timed out: the step goes on until a wait() ends it

    def _add_bucket(self, members: list[int]) -> None:
        offsets: dict[int, int] = {}
        own: dict[int, np.ndarray] = {}
        total = 0
        for i in members:
            shape, dtype = self._layout[i]
            if i in self._own:
                own[i] = np.zeros(shape, dtype)
            else:
                offsets[i] = total
                total += math.prod(shape)
        k = len(self._buckets)
        for j, i in enumerate(members):
            self._where[i] = (k, j)
        dtype = self._layout[members[0]][1]
        c = self._flat_compression
        if isinstance(c, Keyed):  # one key per bucket (Note [keyed compressors in buckets])
            c = c.with_key((c.key, "bucket", k))
        self._buckets.append(_Bucket(members, offsets, np.zeros(total, dtype), c, own))

    @property
    def num_buckets(self) -> int:
        """How many buckets the gradients were packed into."""
        return len(self._buckets)

    def bucket_members(self) -> list[list[int]]:
        """The gradient indexes of each bucket, in the order buckets start: each bucket's in
        backward order, one dtype a bucket (Note [a bucket per dtype] in
        :mod:`plait._bucket_layout`)."""
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
            ValueError: ``index`` is out of range or was already marked this
                step, or ``grad`` has the wrong shape or dtype or is missing,
                or is read-only.
            TypeError: ``index`` is not an int, or ``grad`` cannot be changed
                in place (a JAX array, a list; Note [writing the averages back]).
        """
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"Bucketer.ready: index must be an int (a gradient's); got {index!r}")
        if not 0 <= index < len(self._layout):
            raise ValueError(f"gradient index {index} out of range 0..{len(self._layout) - 1}")
        if self._outs[index] is not None:
            if self._held:
                raise ValueError(
                    f"gradient {index} was already marked ready this step, whose wait() timed "
                    "out: the step goes on until a wait() finishes it"
                )
            raise ValueError(
                f"gradient {index} was already marked ready this step; wait() ends a step. "
                "To accumulate gradients over several backward passes, add them up in the "
                "gradient's array and mark each gradient ready once a step, after the last"
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
        k, _ = self._where[index]
        bucket = self._buckets[k]
        if index in bucket.own:
            bucket.own[index][...] = target
        else:
            start = bucket.offsets[index]
            bucket.buffer[start : start + target.size] = target.reshape(-1)  # a copy serves
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
            # Every rank starts the same calls in the same order: the own ones by index, then
            # the flat buffer's (Note [PowerSGD in buckets]).
            calls = [(a, self._own[i]) for i, a in b.own.items()]
            if b.buffer.size or not b.own:
                calls.append((b.buffer, b.compression))
            try:
                for a, c in calls:
                    kwargs = {} if c is None else {"compression": c}
                    b.works.append(self.comm.allreduce(a, self.op, out=a, async_op=True, **kwargs))
            except BaseException:
                # The step cannot finish: the buckets started finish on every rank, and the
                # next ready() begins a new step (not this bucket again, for another gradient).
                self._abandon()
                raise
            self._next += 1

    def wait(self, timeout: float | None = None) -> None:
        """Finish every bucket and write the results into the gradients; ready for a new step.

        ``timeout`` bounds the wait for each of a bucket's allreduces (one, and one more
        for each gradient PowerSGD compresses apart: Note [PowerSGD in buckets]). Where it
        passes first, the allreduces go on, nothing is reset, and a later :meth:`wait`
        finishes the step (gradients already written are written again with the same values).

        Raises:
            ValueError: some gradients were never marked ready this step (their
                indexes are named); nothing was started for their buckets.
            CommTimeout: ``timeout`` passed first (the step goes on: call wait again).
            CommError: a bucket's allreduce failed; the message names the gradients that
                hold the step's results and those that hold this rank's own values (Note
                [what a failed step leaves]), and a new step begins.
        """
        missing = [i for i, out in enumerate(self._outs) if out is None]
        if missing:
            self._abandon()
            raise ValueError(f"gradients {missing} were not marked ready before wait()")
        running = False  # a bucket's allreduce goes on: its buffer is not ours to reuse yet
        try:
            for k, b in enumerate(self._buckets):
                assert b.works  # every gradient ready: every bucket started
                for work in b.works:
                    try:
                        work.wait(timeout)
                    except CommError as exc:
                        if isinstance(exc, CommTimeout) and not work.done():
                            running = True  # ours passed first, not the allreduce's own
                            raise
                        raise self._failed(k, exc) from exc
                for i in b.members:
                    # Through an array of the gradient's shape, never out.reshape(-1)
                    # (Note [writing the averages back]).
                    if i in b.own:
                        self._outs[i][...] = b.own[i]
                        continue
                    shape, start = self._layout[i][0], b.offsets[i]
                    self._outs[i][...] = b.buffer[start : start + math.prod(shape)].reshape(shape)
        finally:
            if running:
                self._held = True
            else:  # done, or failed: the other buckets' allreduces end, a new step begins
                self._abandon()

    def _failed(self, k: int, exc: CommError) -> CommError:
        """The error :meth:`wait` raises where bucket ``k``'s allreduce failed with ``exc``:
        its message, and what it left in each gradient (Note [what a failed step leaves])."""
        written = sorted(i for b in self._buckets[:k] for i in b.members)
        kept = sorted(i for b in self._buckets[k:] for i in b.members)
        said = f"Bucketer.wait: the allreduce of bucket {k} (bucket_members()[{k}]) failed; "
        if written:
            said += (
                f"gradients {written} hold this step's results (their buckets finished "
                f"first and were written back) and gradients {kept} hold this rank's own "
                "values, as given to ready()"
            )
        else:
            said += "no gradient was written: each holds this rank's own values"
        said += "; no gradient is undefined: the output buffer said to be is the bucket's own"
        noted = type(exc)(f"{exc}; {said}")
        noted.__dict__.update(exc.__dict__)  # PeerLostError.lost_rank
        return noted

    def _abandon(self) -> None:
        """Drop this step: its allreduces finish (every rank started them), and a new step
        begins. Their errors are not raised here: a failed one broke the communicator,
        whose next call says so."""
        try:
            for b in self._buckets:
                for work in b.works:
                    with contextlib.suppress(Exception):
                        work.wait()
        finally:
            self._reset()

    def _reset(self) -> None:
        for b in self._buckets:
            b.pending = len(b.members)
            b.works = []
        self._outs = [None] * len(self._layout)
        self._next = 0
        self._held = False


class Attached:
    """What :func:`attach` returns: call it to end a step; ``no_sync()`` to accumulate.

    ``finish()`` (or ``finish(timeout)``) is :meth:`Bucketer.wait` of the module's
    Bucketer: it waits for the step's buckets and writes the averages into every
    ``param.grad``. See Note [a step under attach].
    """

    def __init__(self, bucketer: Bucketer, names: list[str]) -> None:
        self.bucketer = bucketer
        self._names = names  # each gradient's parameter, as named_parameters() names it
        self._handing = True  # False inside no_sync()

    def __call__(self, timeout: float | None = None) -> None:
        self.bucketer.wait(timeout)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside hand no gradient over: gradients add up in ``.grad``.

        Gradient accumulation, as DDP's ``no_sync()``: run every backward of a step but
        the last inside it, the last outside it (its hooks hand over the sums), then
        ``finish()``.

        Raises:
            ValueError: gradients of this step were handed over already (enter it before
                the step's first backward, or call ``finish()`` first).
        """
        if any(out is not None for out in self.bucketer._outs):
            raise ValueError(
                "attach: enter no_sync() before the step's first backward: this step has "
                "handed gradients over already (finish() ends it)"
            )
        before, self._handing = self._handing, False
        try:
            yield
        finally:
            self._handing = before

    def _hook(self, index: int, param: Any) -> None:
        """Hand parameter ``index``'s gradient over; an error drops the step (Note [a step
        under attach])."""
        if not self._handing:
            return
        b, name = self.bucketer, self._names[index]
        if b._held:
            raise ValueError(
                f"attach: parameter {name!r} got a gradient while the last step goes on: its "
                "finish(timeout) timed out; call finish() again (it writes that step's "
                "averages) before the next backward"
            )
        if b._outs[index] is not None:
            b._abandon()
            raise ValueError(
                f"attach: parameter {name!r} got a second gradient before finish() ended the "
                "step, so this step was dropped (its allreduces finished, no average was "
                "written; the next backward begins a new step). To accumulate gradients "
                "over several backward passes, run all but the last inside "
                "`with finish.no_sync():`, finish being what attach returned"
            )
        grad = param.grad.detach()
        if grad.layout is not _torch().strided:
            b._abandon()
            raise TypeError(
                f"attach: parameter {name!r} got a {grad.layout} gradient, and a bucket holds "
                "dense arrays only, so this step was dropped (its allreduces finished, no "
                "average was written; the next backward begins a new step). Make what reads "
                "the parameter give a dense gradient (sparse=False)"
            )
        try:
            b.ready(index, grad)
        except BaseException as exc:
            b._abandon()
            exc.add_note(
                f"attach: parameter {name!r}: this step was dropped (its allreduces finished, "
                "no average was written); the next backward begins a new step"
            )
            raise


def attach(
    module: Any,
    comm: Any,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    op: Op = AVG,
    compression: Any = None,
) -> Attached:
    """Average a torch module's gradients over ``comm`` while its backward runs.

    Registers a post-accumulate-grad hook on every parameter that requires a
    gradient (torch >= 2.1); each hook hands the gradient to a
    :class:`Bucketer` at once. Call what it returns (``finish``, an
    :class:`Attached`) after ``loss.backward()`` and before
    ``optimizer.step()``: it waits for the buckets and writes the averages
    into every ``param.grad``. To accumulate gradients over several backward
    passes, run all but the last inside ``with finish.no_sync():``; a second
    backward before ``finish()`` is refused. An error in a hook drops the
    step, and the next backward begins a new one (Note [a step under attach]).

    Every parameter must receive a gradient in every step (as with DDP's
    default ``find_unused_parameters=False``); the function raises
    ValueError naming those that did not. Gradient ``i`` in its messages is
    the ``i``-th of ``module.parameters()`` that requires a gradient. ``bucket_bytes``, ``op`` and
    ``compression`` are the :class:`Bucketer`'s, checked as it checks them
    before any hook is registered (PowerSGD compresses each parameter's
    gradient as its own matrix: Note [PowerSGD in buckets]).

    Raises:
        TypeError: a submodule that makes sparse gradients (``nn.Embedding`` or
            ``nn.EmbeddingBag`` with ``sparse=True``), and what the Bucketer refuses
            (Note [refused when built]).
    """
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the module has no parameters that require a gradient")
    _refuse_sparse(module)
    layout = [
        (tuple(p.shape), torch_dtype(p.dtype, f"attach: parameter {i} ({tuple(p.shape)})"))
        for i, (_, p) in enumerate(named)
    ]
    bucketer = Bucketer(comm, layout, bucket_bytes=bucket_bytes, op=op, compression=compression)
    attached = Attached(bucketer, [name for name, _ in named])
    for i, (_, p) in enumerate(named):

        def hook(param: Any, i: int = i) -> None:
            attached._hook(i, param)

        p.register_post_accumulate_grad_hook(hook)
    return attached


def _torch() -> Any:
    """torch, imported where a torch module is attached (plait runs without it)."""
    import torch

    return torch


def _refuse_sparse(module: Any) -> None:
    """Refuse a module whose backward will make a sparse gradient (Note [refused when built]).

    Raises:
        TypeError: an ``nn.Embedding`` or ``nn.EmbeddingBag`` made with ``sparse=True``
            whose weight requires a gradient (the message names it).
    """
    torch = _torch()
    for name, m in module.named_modules():
        kinds = torch.nn.Embedding | torch.nn.EmbeddingBag
        if isinstance(m, kinds) and m.sparse and m.weight.requires_grad:
            where = f"module {name!r}" if name else "the module"
            raise TypeError(
                f"attach: {where}, {m!r}, was made with sparse=True: its gradients are sparse, "
                "and a bucket holds dense arrays only. Make it with sparse=False (its gradient "
                "is then dense, of its weight's shape), or attach the rest of the model and "
                "reduce its gradient with calls of your own"
            )


def _own_compressors(
    compression: Any, layout: Sequence[tuple[tuple[int, ...], np.dtype]]
) -> dict[int, Any] | None:
    """The gradients PowerSGD compresses as matrices, each with the compressor to pass for it
    (Note [PowerSGD in buckets]); None for every other compression (or none)."""
    keyed = isinstance(compression, Keyed)
    inner = compression.inner if keyed else compression
    if not isinstance(inner, PowerSGD):
        return None
    return {
        i: compression.with_key((compression.key, i)) if keyed else inner
        for i, (shape, _) in enumerate(layout)
        if inner.matrix_shape(shape) is not None
    }


def _check_compressible(layout: Sequence[tuple[tuple[int, ...], np.dtype]], op: Op) -> None:
    """Refuse at construction what a compressed allreduce of a bucket would refuse at its
    start, mid-step: a gradient that is not floating point, or an op but SUM and AVG.

    The rule is the communicator's (``allreduce(compression=...)``): float data of at most
    8 bytes an element, in either byte order."""
    for i, (_, dtype) in enumerate(layout):
        if dtype.kind != "f" or dtype.itemsize > 8:
            raise TypeError(
                f"Bucketer: gradient {i} is {dtype}; compression needs float16, float32 or "
                "float64 gradients (reduce the others with a Bucketer of their own)"
            )
    if op is not SUM and op is not AVG:
        raise ValueError(f"Bucketer: compression supports plait.SUM and plait.AVG; got {op!r}")
