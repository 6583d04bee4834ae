"""Requests: a checked call turned into flat arrays, a cached plan and a result to return.

Below the API edge nothing re-checks a call: :class:`Stager` turns the checked
arguments into an immutable :class:`Request` that the call runner
(:mod:`plait._runner`) executes. What depends only on the call's shape
(context, schedule, check word) is a :class:`Plan`, built once per shape.
``allreduce(compression=...)`` goes to its compressor instead
(:mod:`plait._compressed`).

Note [in-place and staging]
    ``out=x`` makes OUT the same memory as IN. Algorithms that are correct
    under that aliasing (every allreduce: they copy IN to OUT first and then
    work in OUT) run on it directly; the others get a private copy of the
    input. Non-contiguous inputs are copied into contiguous staging and
    non-contiguous outputs are written back after success, so any strided
    numpy array works, at the price of a copy.

Note [byte order]
    Schedules, transports and the check word work in native byte order only:
    the bytes of a big-endian ``>f8`` array summed as little-endian doubles
    are garbage, and a rank passing ``>f8`` while the others pass ``<f8``
    would silently disagree. numpy users meet such arrays when they read
    files (``np.fromfile(f, ">f8")``, FITS, HDF5), so a call with ``x`` or
    ``out`` in the other byte order is converted instead of refused: ``x`` is
    copied into native order (byte swapping is exact), the call runs on
    native staging, and the result is written back on success into ``out``
    or into a new array of the caller's dtype, as for a non-contiguous
    ``out``. ``out=`` and ``out=x`` keep their promise (the caller's array
    holds the result and is returned), at the price of one copy each way;
    native arrays pay one attribute test. The plan, and so the check word,
    carries the native dtype, so ranks that pass the same values in
    different byte orders agree; the check word holds ``dtype.str``, byte
    order included, so a mismatch can never hide behind equal names.

Note [calls within calls]
    Some calls are made of others: ``split`` allgathers each rank's color
    and key, ``bcast_object`` broadcasts a length and then the bytes, an
    uneven call without counts allgathers them first. Such an inner call
    looked exactly like a user's call of the same shape, so one rank's
    ``split`` against the others' ``allgather`` of two int64 went through
    as if they matched (over messages the ranks even ended as if it had
    succeeded). An inner call carries its ``purpose`` (the outer call's
    name) in its plan and check word, so it matches only the same inner
    call, and a mismatch error names it. It never takes a kept request of
    the user's calls (Note [the short path] in :mod:`plait._shortcut`): it
    passes the communicator's timeout, which the short path leaves to the
    long one. It keeps one of its own instead, keyed with its purpose, which
    only inner calls look up (``UnevenMethods._within``).
"""

from __future__ import annotations

import functools
import math
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from plait import _arrays, _tensor, collectives
from plait._arrays import DeviceTarget
from plait._checks import CACHE_LIMIT
from plait.algos._registry import AlgorithmSpec, build_schedule
from plait.diagnostics.recorder import CallShape, caller_site
from plait.ops import Op
from plait.runtime.line import line_of
from plait.runtime.work import Work
from plait.schedule.builder import Context, HostLayout
from plait.schedule.ir import Buf, StepKind

if TYPE_CHECKING:
    from plait.selection.select import Choice

__all__ = [
    "Plan",
    "Request",
    "Stager",
    "call_digest",
    "finished",
]


class Request(NamedTuple):
    """A validated call: everything below the API edge trusts it.

    A named tuple rather than a frozen dataclass: just as immutable, and made
    in a third of the time (a frozen dataclass sets each field through
    ``object.__setattr__``), which counts on a path taken by every call.
    """

    spec: AlgorithmSpec
    ctx: Context
    op: Op | None
    inp: np.ndarray  # flat, contiguous
    out: np.ndarray  # flat, contiguous; may be the same memory as inp
    # caller's non-contiguous destination, or its array in device memory, filled on success
    writeback: np.ndarray | DeviceTarget | None
    result: Any  # what the call returns on success (Note [result types] in plait.communicator)
    writes_caller_memory: bool  # a failure leaves caller memory undefined
    average: bool  # divide the reduced elements by size on success
    plan: Plan  # what depends only on the call's shape, cached
    aliased: bool  # inp and out are the same memory (an in-place call)
    # makes the result in the caller's type once the call is done (a JAX or device x), or None
    finish: Callable[[Any], Any] | None = None


class Plan:
    """The parts of a call that depend only on its shape, computed once per shape.

    A training loop or benchmark repeats a few call shapes; caching the
    context, schedule, digest and error-state need keeps per-call work small.
    ``local``: the schedule only copies and reduces within this rank (one
    rank, or a rank with nothing to exchange), so the executor's loop over
    messages is skipped; ``void_in_place``: in place, it does nothing at all;
    ``windowed``: one-sided, with no scratch memory and no average to take;
    ``line``: the straight-line order of a message-passing schedule with no average to
    take, or None; ``alone``: local, with no scratch memory and no average to take;
    ``named``: the call in messages (``"allgather_object's allgather"`` for an inner call).
    """

    __slots__ = (
        "alone",
        "check",
        "ctx",
        "fills_x",
        "guard",
        "line",
        "local",
        "named",
        "purpose",
        "rows",
        "schedule",
        "shape",
        "ufunc",
        "void_in_place",
        "windowed",
        "writes_out",
    )

    def __init__(
        self,
        spec: AlgorithmSpec,
        ctx: Context,
        dtype: np.dtype,
        op: Op | None,
        purpose: str = "",
        rows: str = "",
    ) -> None:
        self.ctx = ctx
        self.purpose = purpose  # the plait call this one is part of (Note [calls within calls])
        self.rows = rows  # an uneven call's rows, as the counts may not say them
        #: How its messages name it: an inner call as part of the user's call.
        self.named = f"{purpose}'s {ctx.collective}" if purpose else ctx.collective
        # The call writes into its ``x`` (broadcast): OUT is the caller's memory and,
        # on root, the data to send (see plait.collectives).
        self.fills_x = collectives.get(ctx.collective).fills_x
        self.schedule = build_schedule(spec, ctx)
        self.check = call_digest(spec.name, ctx, dtype, op, purpose, rows)
        # The reduction its calls run (only schedules that reduce call it: np.bitwise_or
        # stands in where there is no op, and is never called).
        self.ufunc: np.ufunc = op.kernel(dtype) if op is not None else np.bitwise_or
        # What the flight recorder keeps of each call of this shape (one object, reused).
        self.shape = CallShape(
            ctx.collective, spec.name, ctx.count, dtype, op, ctx.root, caller_site(), purpose
        )
        # numpy warns (an error under -W error) on float overflow or invalid values: silence
        # it only where a reduction can produce one; np.errstate costs about a microsecond.
        reduces = any(s.kind in _REDUCING_STEPS for s in self.schedule.steps)
        self.guard = (
            op is not None
            and (reduces or op.average)
            and (dtype.kind not in "iub" or op.ufunc not in _QUIET_INT_UFUNCS or op.average)
        )
        self.local = not self.schedule.one_sided and all(
            s.kind in _LOCAL_STEPS for s in self.schedule.steps
        )
        # One-sided, without scratch memory or an average to take: the call runner's short
        # path may run it (Note [the one-sided short path] in plait._runner).
        avg = op is not None and op.average
        self.windowed = (
            self.schedule.one_sided
            and not self.schedule.tmp_count
            and not self.schedule.staged_count
            and not avg
        )
        # Within this rank, without scratch memory or an average: the call runner's short
        # path may run it (Note [a rank alone] in plait._runner).
        self.alone = self.local and not self.schedule.tmp_count and not avg
        # Messages in a straight line, no average: the call runner's short path may run it
        # (Note [the straight-line short path] in plait._runner).
        whole = self.local or self.schedule.one_sided or self.schedule.mixed or avg
        self.line = None if whole else line_of(self.schedule, dtype.itemsize)
        # In place (IN and OUT one memory), the schedule does nothing: it only copies IN to
        # OUT at equal offsets (one rank's allreduce).
        self.void_in_place = self.local and all(
            s.kind is StepKind.COPY
            and s.src is not None
            and s.dst is not None
            and s.src.offset == s.dst.offset
            and {s.src.buf, s.dst.buf} == {Buf.IN, Buf.OUT}
            for s in self.schedule.steps
        )
        # Whether a step writes this rank's OUT: broadcast's root sends from its x, which
        # may be read-only there, and only some algorithms write it back (the ring of
        # scatter_allgather hands root its own blocks again).
        self.writes_out = any(
            s.dst is not None and s.dst.buf is Buf.OUT for s in self.schedule.steps
        )


#: The steps that combine with the op (only they can overflow).
_REDUCING_STEPS = frozenset((StepKind.REDUCE, StepKind.RECV_REDUCE, StepKind.GET_REDUCE))
#: The steps that stay within a rank.
_LOCAL_STEPS = frozenset((StepKind.COPY, StepKind.REDUCE))


_new = tuple.__new__  # a named tuple made from a tuple, without the keyword machinery


#: Ufuncs that never warn on integer or bool arrays (they wrap around silently).
_QUIET_INT_UFUNCS = frozenset(
    (
        np.add,
        np.multiply,
        np.maximum,
        np.minimum,
        np.bitwise_and,
        np.bitwise_or,
        np.bitwise_xor,
        np.logical_and,
        np.logical_or,
        np.logical_xor,
    )
)


class Stager:
    """Turns one communicator's checked calls into :class:`Request`\\ s.

    It keeps the plan cache ``plans``, keyed by
    ``(spec, count, dtype, op, root, segment)`` and cleared when it holds
    CACHE_LIMIT plans.
    """

    __slots__ = ("_layout", "_rank", "_size", "_window", "plans")

    def __init__(self, rank: int, size: int, layout: HostLayout | None, window: int = 0) -> None:
        self._rank = rank
        self._size = size
        self._layout = layout
        self._window = window  # bytes of the shared window per call (Context.window); 0: none
        self.plans: dict[tuple[Any, ...], Plan] = {}

    def request(
        self,
        choice: Choice,
        count: int,
        inp: np.ndarray | None,
        out: np.ndarray | None,
        shape: tuple[int, ...],
        op: Op | None,
        *,
        root: int = 0,
        has_out: bool = True,
        result: Any = ...,
        dtype: np.dtype | None = None,
        src: Any = None,
        dst: Any = None,
        counts: tuple[int, ...] | None = None,
        purpose: str = "",
        rows: str = "",
    ) -> Request:
        """Flatten and stage the arrays (see Note [in-place and staging]).

        ``inp`` and ``out`` are the checked arrays (``out`` None: a new array
        of ``shape``; ``has_out`` False: the call writes no output here).
        ``src`` and ``dst`` are the caller's ``x`` and ``out`` as passed, before
        conversion: they decide what the call returns (Note [result types] in
        :mod:`plait.communicator`), unless ``result`` says it. ``counts``: an
        uneven call's checked per-rank element counts (``Context.counts``,
        ``count`` then 0); they are part of the plan's key and check word, as are
        ``purpose`` (Note [calls within calls]) and ``rows``: the shape of an uneven
        call's rows, and their counts where a row holds no element (the element counts
        say neither), so that ranks that disagree on them fail with MismatchError.
        """
        if dtype is None:
            given = inp if inp is not None else out
            assert given is not None, "a call passes inp, out or dtype"
            dtype = given.dtype
        if not dtype.isnative or (out is not None and not out.dtype.isnative):
            return self._in_native_order(
                choice, count, inp, out, shape, op, root, has_out, result, dtype, src, dst, counts,
                purpose, rows,
            )  # fmt: skip
        spec = choice.spec
        segment = choice.segment(dtype.itemsize)
        # An uneven call's key is one longer, so it never meets an even call's.
        key: tuple[Any, ...] = (
            (spec, count, dtype, op, root, segment)
            if counts is None
            else (spec, count, dtype, op, root, segment, counts)
        )
        if purpose:  # an inner call's plan is its own (Note [calls within calls])
            key += (purpose,)
        if rows:
            key += ("rows", rows)
        plan = self.plans.get(key)
        # The buffers come before a new plan: a call too large for memory (a read-only view
        # of 2**50 elements, say) fails at once where its buffer is made, not after building
        # a schedule of its billions of pieces.
        fills_x = plan.fills_x if plan is not None else collectives.get(spec.collective).fills_x
        same_array = inp is not None and out is inp and inp.flags.c_contiguous
        flat_in = _flat(inp) if inp is not None else np.empty(0, dtype)
        writeback: np.ndarray | DeviceTarget | None = None
        finish = None
        caller_out = out is not None
        if not has_out:
            flat_out = np.empty(0, dtype)
        elif out is None:
            new = _new_result(shape, dtype, f"rank {self._rank}: {spec.collective}")
            flat_out = new.reshape(-1)
            if result is ...:
                # A JAX or device x gets its result made once the call is done (finish).
                finish = None if src is inp else _arrays.finisher(src)
                result = new if src is inp or finish is not None else _tensor.like(src, new)
        elif (
            dst is not None
            and dst is not out
            and (not fills_x or root != self._rank)
            and (writeback := _arrays.target(dst, out)) is not None
        ):
            # out (broadcast's x) is a host buffer standing in for an array in device memory,
            # copied back once the call succeeds (Note [staging through the host] in
            # plait._arrays); broadcast's root only sends from it.
            flat_out = out.reshape(-1)
            if result is ...:
                result = dst
        else:
            if out.flags.c_contiguous:
                flat_out = out.reshape(-1)
            else:
                # A call that fills x (broadcast) sends root's data from OUT, so its
                # staging starts as a copy.
                flat_out = (
                    np.ascontiguousarray(out).reshape(-1) if fills_x else np.empty(out.size, dtype)
                )
                if not fills_x or root != self._rank:  # broadcast's root only reads its x
                    writeback = out
            if result is ...:
                result = out if dst is None else dst
        if plan is None:
            ctx = Context(
                spec.collective,
                self._rank,
                self._size,
                count,
                dtype.itemsize,
                op.commutative if op is not None else True,
                root,
                segment,
                self._layout,
                counts=counts,
                window=self._window,
            )
            if len(self.plans) >= CACHE_LIMIT:
                self.plans.clear()
            plan = self.plans[key] = Plan(spec, ctx, dtype, op, purpose, rows)
        if result is ...:
            result = None
        aliased = False
        if same_array and flat_in.size == flat_out.size:
            aliased = spec.in_place
            if not aliased and flat_in.size:
                flat_in = flat_in.copy()
        elif flat_in.size and flat_out.size and np.may_share_memory(flat_in, flat_out):
            same = flat_in.ctypes.data == flat_out.ctypes.data and flat_in.size == flat_out.size
            aliased = same and spec.in_place
            if not aliased:
                flat_in = flat_in.copy()
        return Request(
            spec=spec,
            ctx=plan.ctx,
            op=op,
            inp=flat_in,
            out=flat_out,
            writeback=writeback,
            result=result,
            # An inner call's memory is plait's own (Note [calls within calls]).
            writes_caller_memory=not purpose and (root != self._rank if fills_x else caller_out),
            average=op is not None and op.average,
            plan=plan,
            aliased=aliased,
            finish=finish,
        )

    def _in_native_order(
        self,
        choice: Choice,
        count: int,
        inp: np.ndarray | None,
        out: np.ndarray | None,
        shape: tuple[int, ...],
        op: Op | None,
        root: int,
        has_out: bool,
        result: Any,
        dtype: np.dtype,
        src: Any,
        dst: Any,
        counts: tuple[int, ...] | None,
        purpose: str,
        rows: str,
    ) -> Request:
        """The request of a call whose ``x`` or ``out`` is not in native byte order.

        See Note [byte order]: the input is converted, the call runs on
        native staging and writes back on success into the caller's ``out``
        or a new array of the caller's dtype.
        """
        native = dtype.newbyteorder("=")
        if inp is not None and not inp.dtype.isnative:
            inp = np.ascontiguousarray(inp, native)
        stage = target = None
        if has_out:
            target = out if out is not None else np.empty(shape, dtype)
            if result is ...:
                result = target if dst is None else dst
            if target.dtype.isnative:  # only x needed converting
                stage, target = target, None
            elif collectives.get(choice.spec.collective).fills_x:
                stage = np.ascontiguousarray(target, native)  # root sends from OUT (broadcast)
            else:
                stage = np.empty(shape, native)
        req = self.request(
            choice, count, inp, stage, shape, op, root=root, has_out=has_out,
            result=result, dtype=native, src=src, dst=dst, counts=counts, purpose=purpose,
            rows=rows,
        )  # fmt: skip
        if target is None or (req.plan.fills_x and root == self._rank):
            return req  # (broadcast's root only reads its x: nothing to write back there)
        return req._replace(
            writeback=target,
            writes_caller_memory=not purpose and (req.plan.fills_x or out is not None),
        )


def finished(result: Any, finish: Callable[[Any], Any], async_op: bool) -> Any:
    """A started call's ``result`` (a :class:`Work` for ``async_op``) passed through ``finish``.

    ``finish`` is a request's: it makes a JAX or device ``x``'s result in the
    caller's type once the call has succeeded (:func:`plait._arrays.finisher`).
    """
    if not async_op:
        return finish(result)
    return _Finishing(result, finish)


class _Finishing(Work[Any]):
    """The Work of a call whose result is made in the caller's type when first waited for.

    It stands in front of the runner's Work: ``wait`` waits for that one,
    then runs ``finish`` once (on the waiting thread, as a blocking call
    would run it on the calling one) and keeps what it gave.
    """

    __slots__ = ("_inner", "_lock", "_make")

    def __init__(self, inner: Work[Any], finish: Callable[[Any], Any]) -> None:
        super().__init__(inner._describe)
        self._inner = inner
        self._make = finish
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the call has finished, successfully or not (never blocks)."""
        return self._inner.done()

    def wait(self, timeout: float | None = None) -> Any:
        """The call's result in the caller's type; raises as :meth:`Work.wait` does."""
        if not self._done.is_set():
            raw = self._inner.wait(timeout)
            with self._lock:
                if not self._done.is_set():
                    try:
                        self._finish(self._make(raw))
                    except BaseException as exc:
                        self._finish(error=exc)
        return super().wait()

    def exception(self) -> BaseException | None:
        """The error the call (or making its result) failed with, or None."""
        return self._inner.exception() or self._error


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1)


@functools.lru_cache(maxsize=4096)
def call_digest(
    algorithm: str, ctx: Context, dtype: np.dtype, op: Op | None, purpose: str = "", rows: str = ""
) -> int:
    """The check word of a call: equal on all ranks exactly when their calls match.

    Cached per call shape: a hot loop repeats the same few calls. An uneven
    call's per-rank counts are part of it, so ranks that disagree on any
    count fail with MismatchError instead of misreading each other's blocks;
    so is the ``purpose`` of a call plait makes within another (Note [calls
    within calls]).
    """
    key = op.key if op is not None else "-"
    # dtype.str, not dtype.name: the name is the same in both byte orders (Note [byte order])
    text = f"{ctx.collective}|{algorithm}|{ctx.count}|{dtype.str}|{key}|{ctx.root}|{ctx.segment}"
    if ctx.counts is not None:
        text += "|" + ",".join(map(str, ctx.counts))
    if purpose:
        text += "|" + purpose
    if rows:
        text += "|rows " + rows
    return zlib.crc32(text.encode())


def _new_result(shape: tuple[int, ...], dtype: np.dtype, where: str) -> np.ndarray:
    """A new result array, or numpy's refusal with the call named: counts that claim more
    rows than memory holds gave numpy's words alone ("array is too big")."""
    try:
        return np.empty(shape, dtype)
    except (ValueError, MemoryError) as exc:  # numpy's MemoryError takes (shape, dtype)
        nbytes = dtype.itemsize * math.prod(shape)
        said = (
            f"{where}: cannot allocate its result of shape {shape} and dtype {dtype} "
            f"({nbytes} bytes), as the counts given say: {exc}"
        )
        raise (MemoryError(said) if isinstance(exc, MemoryError) else ValueError(said)) from None
