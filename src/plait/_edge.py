"""The collectives of :class:`plait.Communicator`: check the arguments, request, start.

Every collective follows one recipe: check its arguments (:mod:`plait._checks`),
choose the algorithm (``Communicator._choose``), turn the call into an
immutable request (:class:`plait._request.Stager`) and hand it to the call
runner (:class:`plait._runner.CallRunner`), which returns the result or, with
``async_op=True``, a :class:`plait.Work`. :class:`CollectiveMethods` holds them so
that :mod:`plait.communicator` keeps the communicator's own life (identity,
groups, point to point, algorithm choice). Six of them (allreduce, reduce,
reduce_scatter, allgather, alltoall, gather) are that recipe and nothing
else: ``CollectiveMethods._collective`` runs it, reading what differs
(root, op, blocks, result shape, whether a rank gets a result) from their
row of :data:`plait.collectives.TABLE` rather than from their names.
Broadcast (which fills ``x``), scatter (whose non-roots may pass only
``out``) and barrier (no data) spell theirs out.

The uneven collectives (allgatherv, gatherv, scatterv, alltoallv and
``reduce_scatter(counts=)``) count rows along axis 0 and share
``CollectiveMethods._uneven``, which turns the rows into the element counts
the plan, the schedule and the check word carry. Every rank needs every
count, so where a caller cannot give them all (gatherv or allgatherv without
counts, scatterv off root, alltoallv's matrix) the call first learns them
with one small even collective (``_after_exchange``); docs/mpi.md says what
each costs.

Typing (see Note [result types] in :mod:`plait.communicator`): a torch tensor
``x`` gives a tensor, anything else a numpy array, ``out=`` gives ``out``
itself (the type variables' defaults say which applies when ``out`` is
omitted); ``async_op=True`` gives a :class:`plait.Work` of that; a plain
``bool`` for ``async_op`` gives either, so it is typed ``Any``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from plait import collectives
from plait._checks import (
    as_array,
    as_writable,
    check_counts,
    check_op,
    check_out,
    check_root,
    check_rows,
    split_rows,
)
from plait.collectives import Collective
from plait.ops import SUM, Op, check_dtype
from plait.runtime.work import Work

if TYPE_CHECKING:
    from typing import Literal, NotRequired, TypedDict, Unpack

    from numpy.typing import NDArray
    from torch import Tensor
    from typing_extensions import TypeVar

    from plait._request import Compression, Stager
    from plait._runner import CallRunner
    from plait.selection.select import Choice

    #: The result for a tensor ``x``: ``out``'s type when given, else a tensor.
    _T = TypeVar("_T", default=Tensor)
    #: The result for any other ``x``: ``out``'s type when given, else a numpy array.
    _A = TypeVar("_A", default=NDArray[Any])
    #: What broadcast fills and returns: ``x`` itself.
    _X = TypeVar("_X")
    #: Rows per rank of an uneven collective: a sequence of ints or a 1-D integer array.
    RowCounts = Sequence[int] | NDArray[np.integer[Any]]

    class Blocking(TypedDict, total=False):
        """The options of a call that returns its result (``async_op=False``, the default)."""

        algorithm: str
        timeout: float | None
        async_op: Literal[False]

    class Async(TypedDict):
        """The options of a call that returns a :class:`plait.Work` (``async_op=True``)."""

        async_op: Literal[True]
        algorithm: NotRequired[str]
        timeout: NotRequired[float | None]

    class Either(TypedDict):
        """The options of a call whose ``async_op`` is a ``bool`` known only at run time."""

        async_op: bool
        algorithm: NotRequired[str]
        timeout: NotRequired[float | None]

    class CompressedBlocking(Blocking, total=False):
        """allreduce's blocking options, with ``compression=``."""

        compression: Compression | None

    class CompressedAsync(Async, total=False):
        """allreduce's async options, with ``compression=``."""

        compression: Compression | None

    class CompressedEither(Either, total=False):
        """allreduce's options for a run-time ``async_op``, with ``compression=``."""

        compression: Compression | None


__all__ = ["CollectiveMethods"]

# Looked up once here, not per call (collectives.get costs a call and a dict lookup).
_ALLREDUCE = collectives.get("allreduce")
_REDUCE = collectives.get("reduce")
_REDUCE_SCATTER = collectives.get("reduce_scatter")
_ALLGATHER = collectives.get("allgather")
_ALLTOALL = collectives.get("alltoall")
_GATHER = collectives.get("gather")
_SCATTER = collectives.get("scatter")
_ALLGATHERV = collectives.get("allgatherv")
_GATHERV = collectives.get("gatherv")
_SCATTERV = collectives.get("scatterv")
_ALLTOALLV = collectives.get("alltoallv")
_REDUCE_SCATTERV = collectives.get("reduce_scatterv")


class CollectiveMethods:
    """The collectives; :class:`plait.Communicator` provides what they use.

    That is the rank, the size, the algorithm choice ``_choose``, the
    compressed allreduce ``_allreduce_compressed``, the cache of accepted
    (op, dtype) pairs, the :class:`~plait._request.Stager` and the
    :class:`~plait._runner.CallRunner`.
    """

    _rank: int
    _size: int
    _checked: set[tuple[Op, np.dtype]]
    _stage: Stager
    _runner: CallRunner

    def _choose(self, c: str, algorithm: Any, nbytes: int, op: Op | None) -> Choice:
        """The algorithm and segment size of a call.

        Defined by :class:`plait.Communicator`, next to the settings and the
        cache of auto's choices it reads.
        """
        raise NotImplementedError

    def _allreduce_compressed(
        self,
        x: Any,
        op: Op,
        out: Any,
        algorithm: Any,
        timeout: float | None,
        async_op: bool,
        compression: Compression,
    ) -> Any:
        """``allreduce(compression=...)`` (defined by the communicator)."""
        raise NotImplementedError

    def _collective(
        self,
        t: Collective,
        x: Any,
        op: Op | None,
        root: int,
        out: Any,
        algorithm: Any,
        timeout: float | None,
        async_op: bool,
    ) -> Any:
        """The recipe of the collectives that read ``x`` and return a new result.

        What differs between them is read from their row ``t`` of
        :data:`plait.collectives.TABLE`, not from their names: whether a root
        and an op are checked, whether axis 0 of ``x`` is cut into ``size``
        blocks, the result's shape, whether this rank gets a result at all
        (``reduce`` and ``gather`` return None off root and ignore ``out``
        there) and the call's count (one block for the block collectives),
        which also sizes the algorithm choice.
        """
        c = t.name
        r = self._rank
        size = self._size
        a = as_array(x, "x", r, c)
        if t.rooted:
            check_root(root, r, size, c)
        if t.reduces:
            check_op(op, a.dtype, r, c, self._checked)
        if t.split_input:
            split_rows(a.shape, r, size, c)
        shape = t.result_shape(a.shape, size)
        # Only a rooted collective can leave a rank without a result (its OUT is empty).
        has_out = not t.rooted or t.counts(size, 1, r, root)[1] > 0
        out_arr = check_out(out, shape, a.dtype, r, c) if has_out else None
        count = t.x_count(a.size, size)
        choice = self._choose(c, algorithm, count * a.itemsize, op)
        req = self._stage.request(
            choice, count, a, out_arr, shape, op, root=root, has_out=has_out, src=x, dst=out
        )
        # 4: the user's frame is beyond this one and the collective method's
        return self._runner.start(req, timeout, async_op, self, 4)

    @overload
    def allreduce(
        self, x: Tensor, op: Op = ..., *, out: _T | None = ..., **kw: Unpack[CompressedBlocking]
    ) -> _T: ...
    @overload
    def allreduce(
        self, x: object, op: Op = ..., *, out: _A | None = ..., **kw: Unpack[CompressedBlocking]
    ) -> _A: ...
    @overload
    def allreduce(
        self, x: Tensor, op: Op = ..., *, out: _T | None = ..., **kw: Unpack[CompressedAsync]
    ) -> Work[_T]: ...
    @overload
    def allreduce(
        self, x: object, op: Op = ..., *, out: _A | None = ..., **kw: Unpack[CompressedAsync]
    ) -> Work[_A]: ...
    @overload
    def allreduce(
        self, x: object, op: Op = ..., *, out: object = ..., **kw: Unpack[CompressedEither]
    ) -> Any: ...
    def allreduce(
        self,
        x: Any,
        op: Op = SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
        compression: Compression | None = None,
    ) -> Any:
        """Reduce ``x`` element-wise over all ranks; every rank gets the result.

        Example with 2 ranks::

            rank 0: x = [1, 2]      rank 1: x = [10, 20]
            comm.allreduce(x)  ->   [11, 22] on both ranks

        Args:
            x: a numpy array (any shape), a torch CPU tensor (bfloat16 too, with
                ml_dtypes), or an object with the buffer protocol, ``__array__``
                or ``__dlpack__``; read in place, without a copy.
            op: a :class:`plait.Op` (``plait.SUM``, ``plait.MAX``, …).
            out: where to write the result (same shape and dtype as x); ``out=x``
                reduces in place. Without it a new array is returned and x is
                never modified.
            algorithm: ``"auto"`` or a name from ``plait.algorithms("allreduce")``.
            timeout: seconds before the call fails with CommTimeout.
            async_op: return a :class:`plait.Work` instead of waiting.
            compression: a :mod:`plait.compression` compressor (fp16, bf16,
                int8, top-k, PowerSGD): fewer bytes on the wire for an
                approximate SUM or AVG of float arrays. The compressor picks
                its own collectives (``algorithm`` must stay "auto").

        Returns:
            The reduced array, identical bit for bit on all ranks: ``out`` if
            given, else a new torch tensor for a tensor ``x`` and a new numpy
            array for anything else.
        """
        if compression is not None:
            return self._allreduce_compressed(x, op, out, algorithm, timeout, async_op, compression)
        return self._collective(_ALLREDUCE, x, op, 0, out, algorithm, timeout, async_op)

    @overload
    def reduce(
        self,
        x: Tensor,
        root: int = ...,
        op: Op = ...,
        *,
        out: _T | None = ...,
        **kw: Unpack[Blocking],
    ) -> _T | None: ...
    @overload
    def reduce(
        self,
        x: object,
        root: int = ...,
        op: Op = ...,
        *,
        out: _A | None = ...,
        **kw: Unpack[Blocking],
    ) -> _A | None: ...
    @overload
    def reduce(
        self, x: Tensor, root: int = ..., op: Op = ..., *, out: _T | None = ..., **kw: Unpack[Async]
    ) -> Work[_T | None]: ...
    @overload
    def reduce(
        self, x: object, root: int = ..., op: Op = ..., *, out: _A | None = ..., **kw: Unpack[Async]
    ) -> Work[_A | None]: ...
    @overload
    def reduce(
        self, x: object, root: int = ..., op: Op = ..., *, out: object = ..., **kw: Unpack[Either]
    ) -> Any: ...
    def reduce(
        self,
        x: Any,
        root: int = 0,
        op: Op = SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` element-wise over all ranks onto ``root``.

        Returns the reduced array on ``root`` (``out`` if given) and None
        elsewhere; ``out`` is ignored on other ranks.
        """
        return self._collective(_REDUCE, x, op, root, out, algorithm, timeout, async_op)

    @overload
    def broadcast(self, x: _X, root: int = ..., **kw: Unpack[Blocking]) -> _X: ...
    @overload
    def broadcast(self, x: _X, root: int = ..., **kw: Unpack[Async]) -> Work[_X]: ...
    @overload
    def broadcast(self, x: object, root: int = ..., **kw: Unpack[Either]) -> Any: ...
    def broadcast(
        self,
        x: Any,
        root: int = 0,
        *,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Copy root's ``x`` into ``x`` on every rank, in place; returns ``x``.

        Every rank passes an array of the same shape and dtype; on ranks other
        than root it must be writeable.
        """
        c = "broadcast"
        a = as_writable(x, "x", self._rank, c)
        check_root(root, self._rank, self._size, c)
        if self._rank != root and not a.flags.writeable:
            raise ValueError(f"rank {self._rank}: {c}: x is read-only; it receives root's data")
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._stage.request(choice, a.size, None, a, a.shape, None, root=root, result=x)
        return self._runner.start(req, timeout, async_op, self)

    @overload
    def reduce_scatter(
        self,
        x: Tensor,
        op: Op = ...,
        *,
        counts: RowCounts | None = ...,
        out: _T | None = ...,
        **kw: Unpack[Blocking],
    ) -> _T: ...
    @overload
    def reduce_scatter(
        self,
        x: object,
        op: Op = ...,
        *,
        counts: RowCounts | None = ...,
        out: _A | None = ...,
        **kw: Unpack[Blocking],
    ) -> _A: ...
    @overload
    def reduce_scatter(
        self,
        x: Tensor,
        op: Op = ...,
        *,
        counts: RowCounts | None = ...,
        out: _T | None = ...,
        **kw: Unpack[Async],
    ) -> Work[_T]: ...
    @overload
    def reduce_scatter(
        self,
        x: object,
        op: Op = ...,
        *,
        counts: RowCounts | None = ...,
        out: _A | None = ...,
        **kw: Unpack[Async],
    ) -> Work[_A]: ...
    @overload
    def reduce_scatter(
        self,
        x: object,
        op: Op = ...,
        *,
        counts: RowCounts | None = ...,
        out: object = ...,
        **kw: Unpack[Either],
    ) -> Any: ...
    def reduce_scatter(
        self,
        x: Any,
        op: Op = SUM,
        *,
        counts: RowCounts | None = None,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce over ranks, then split: rank r gets rows ``r*k:(r+1)*k`` of the result.

        Axis 0 of ``x`` must have ``size * k`` rows; the result has shape
        ``(k, *x.shape[1:])``.

        ``counts=`` (one row count per rank, MPI_Reduce_scatter's recvcounts)
        splits unevenly instead: axis 0 of ``x`` has ``sum(counts)`` rows and
        rank r gets the ``counts[r]`` rows from ``sum(counts[:r])`` on, reduced.
        It runs ``reduce_scatterv`` (``plait.algorithms("reduce_scatterv")``
        names its algorithms); every rank passes the same counts.
        """
        if counts is None:
            return self._collective(_REDUCE_SCATTER, x, op, 0, out, algorithm, timeout, async_op)
        t = _REDUCE_SCATTERV
        c = "reduce_scatter"
        r = self._rank
        a = as_array(x, "x", r, c)
        check_op(op, a.dtype, r, c, self._checked)
        rows = check_counts(counts, self._size, "counts", r, c)
        check_rows(a.shape, sum(rows), "sum(counts)", r, c)
        return self._uneven(
            t, a, a.dtype, a.shape[1:], rows, rows[r], op, 0, x, out, algorithm, timeout, async_op
        )

    @overload
    def allgather(self, x: Tensor, *, out: _T | None = ..., **kw: Unpack[Blocking]) -> _T: ...
    @overload
    def allgather(self, x: object, *, out: _A | None = ..., **kw: Unpack[Blocking]) -> _A: ...
    @overload
    def allgather(self, x: Tensor, *, out: _T | None = ..., **kw: Unpack[Async]) -> Work[_T]: ...
    @overload
    def allgather(self, x: object, *, out: _A | None = ..., **kw: Unpack[Async]) -> Work[_A]: ...
    @overload
    def allgather(self, x: object, *, out: object = ..., **kw: Unpack[Either]) -> Any: ...
    def allgather(
        self,
        x: Any,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``x`` on every rank: shape ``(size, *x.shape)``, rank order."""
        return self._collective(_ALLGATHER, x, None, 0, out, algorithm, timeout, async_op)

    @overload
    def alltoall(self, x: Tensor, *, out: _T | None = ..., **kw: Unpack[Blocking]) -> _T: ...
    @overload
    def alltoall(self, x: object, *, out: _A | None = ..., **kw: Unpack[Blocking]) -> _A: ...
    @overload
    def alltoall(self, x: Tensor, *, out: _T | None = ..., **kw: Unpack[Async]) -> Work[_T]: ...
    @overload
    def alltoall(self, x: object, *, out: _A | None = ..., **kw: Unpack[Async]) -> Work[_A]: ...
    @overload
    def alltoall(self, x: object, *, out: object = ..., **kw: Unpack[Either]) -> Any: ...
    def alltoall(
        self,
        x: Any,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Exchange blocks: axis 0 of ``x`` is cut in ``size`` equal parts, part j goes to rank j.

        Returns the parts received, in rank order, with the shape of ``x``.
        """
        return self._collective(_ALLTOALL, x, None, 0, out, algorithm, timeout, async_op)

    @overload
    def gather(
        self, x: Tensor, root: int = ..., *, out: _T | None = ..., **kw: Unpack[Blocking]
    ) -> _T | None: ...
    @overload
    def gather(
        self, x: object, root: int = ..., *, out: _A | None = ..., **kw: Unpack[Blocking]
    ) -> _A | None: ...
    @overload
    def gather(
        self, x: Tensor, root: int = ..., *, out: _T | None = ..., **kw: Unpack[Async]
    ) -> Work[_T | None]: ...
    @overload
    def gather(
        self, x: object, root: int = ..., *, out: _A | None = ..., **kw: Unpack[Async]
    ) -> Work[_A | None]: ...
    @overload
    def gather(
        self, x: object, root: int = ..., *, out: object = ..., **kw: Unpack[Either]
    ) -> Any: ...
    def gather(
        self,
        x: Any,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's ``x`` on root: shape ``(size, *x.shape)`` there, None elsewhere."""
        return self._collective(_GATHER, x, None, root, out, algorithm, timeout, async_op)

    @overload
    def scatter(
        self, x: Tensor, root: int = ..., *, out: _T | None = ..., **kw: Unpack[Blocking]
    ) -> _T: ...
    @overload
    def scatter(
        self, x: object, root: int = ..., *, out: _A | None = ..., **kw: Unpack[Blocking]
    ) -> _A: ...
    @overload
    def scatter(
        self, x: Tensor, root: int = ..., *, out: _T | None = ..., **kw: Unpack[Async]
    ) -> Work[_T]: ...
    @overload
    def scatter(
        self, x: object, root: int = ..., *, out: _A | None = ..., **kw: Unpack[Async]
    ) -> Work[_A]: ...
    @overload
    def scatter(
        self, x: object, root: int = ..., *, out: object = ..., **kw: Unpack[Either]
    ) -> Any: ...
    def scatter(
        self,
        x: Any,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Split root's ``x`` along axis 0 in ``size`` parts; rank r gets part r.

        On root, axis 0 of ``x`` must have ``size * k`` rows. Other ranks pass
        an array of the same shape and dtype (its contents are not used) or
        ``x=None`` with ``out`` of shape ``(k, *x.shape[1:])``.
        """
        t = _SCATTER
        c = t.name
        r = self._rank
        check_root(root, r, self._size, c)
        is_root = r == root
        if x is None and not is_root:
            if out is None:
                raise ValueError(
                    f"rank {r}: {c}: pass x (root's shape and dtype) or out= on non-root"
                )
            o = as_writable(out, "out", r, c)
            shape: tuple[int, ...] = tuple(o.shape)
            if not shape:
                raise ValueError(f"rank {r}: {c}: out must have at least one dimension")
            dtype = o.dtype
            check_dtype(dtype)
            a = np.empty(0, dtype)
        else:
            a = as_array(x, "x", r, c)
            split_rows(a.shape, r, self._size, c)
            shape = t.result_shape(a.shape, self._size)
            dtype = a.dtype
        out_arr = check_out(out, shape, dtype, r, c)
        count = int(np.prod(shape, dtype=np.int64))  # t.x_count of root's x
        choice = self._choose(c, algorithm, count * dtype.itemsize, None)
        inp = a if is_root else None
        req = self._stage.request(
            choice, count, inp, out_arr, shape, None, root=root, dtype=dtype, src=x, dst=out
        )
        return self._runner.start(req, timeout, async_op, self)

    @overload
    def barrier(self, *, timeout: float | None = ..., async_op: Literal[False] = ...) -> None: ...
    @overload
    def barrier(self, *, timeout: float | None = ..., async_op: Literal[True]) -> Work[None]: ...
    @overload
    def barrier(self, *, timeout: float | None = ..., async_op: bool) -> Work[None] | None: ...
    def barrier(self, *, timeout: float | None = None, async_op: bool = False) -> Any:
        """Return only once every rank has entered the barrier."""
        c = "barrier"
        choice = self._choose(c, "auto", 0, None)
        empty = np.empty(0, np.uint8)
        req = self._stage.request(choice, 0, empty, None, (0,), None, has_out=False, result=None)
        return self._runner.start(req, timeout, async_op, self)

    # -- uneven collectives: per-rank row counts (docs/mpi.md, "Uneven collectives") ----------

    def _uneven(
        self,
        t: Collective,
        inp: np.ndarray | None,
        dtype: np.dtype,
        rest: tuple[int, ...],
        rows: tuple[int, ...],
        out_rows: int | None,
        op: Op | None,
        root: int,
        x: Any,
        out: Any,
        algorithm: Any,
        timeout: float | None,
        async_op: bool,
    ) -> Any:
        """Start an uneven call whose arguments are checked and whose ``rows`` every rank knows.

        ``rows``: rows per rank (alltoallv: the size×size matrix, row-major);
        ``rest``: the shape of one row; ``out_rows``: the rows of this rank's
        result, None where it gets none (gatherv off root). The counts go
        below as element counts of the flat buffers, into the plan's key and
        the check word, so ranks that disagree on a count, or on the size of
        a row, fail with MismatchError instead of misreading each other.
        """
        size = self._size
        row = int(np.prod(rest, dtype=np.int64))
        has_out = out_rows is not None
        shape = (out_rows or 0, *rest)
        out_arr = check_out(out, shape, dtype, self._rank, t.name) if has_out else None
        elems = tuple(k * row for k in rows)
        nbytes = (
            t.uneven_whole(size, elems) * dtype.itemsize // size
        )  # auto sizes by the mean block
        choice = self._choose(t.name, algorithm, nbytes, op)
        req = self._stage.request(
            choice, 0, inp, out_arr, shape, op, root=root, has_out=has_out,
            dtype=dtype, src=x, dst=out, counts=elems,
        )  # fmt: skip
        return self._runner.start(req, timeout, async_op, self, 4)

    def _check_algorithm(self, c: str, algorithm: Any) -> None:
        """Refuse a bad ``algorithm=`` before a count exchange, not after it (on one rank)."""
        if algorithm != "auto":
            self._choose(c, algorithm, 0, None)

    def _after_exchange(
        self,
        c: str,
        exchange: Callable[[], np.ndarray],
        finish: Callable[[np.ndarray], Any],
        async_op: bool,
    ) -> Any:
        """Exchange counts (one small collective), then make the call (``finish``, one more).

        With ``async_op`` both run on the worker thread; their sequence numbers
        are reserved now, in call order, as a compressed allreduce's are, so
        calls made meanwhile cannot take their places.
        """
        if not async_op:
            return finish(exchange())
        work: Work[Any] = Work(f"rank {self._rank}: {c} (after its count exchange)")
        runner = self._runner
        if runner.detail:
            # PLAIT_DEBUG=detail checks each call with a nested allgather: run here.
            try:
                work._finish(finish(exchange()))
            except BaseException as exc:
                work._finish(error=exc)
            return work
        runner.submit_reserved(work, 2, c, lambda: finish(exchange()))
        return work

    @overload
    def allgatherv(
        self, x: Tensor, counts: RowCounts | None = ..., *, out: _T | None = ...,
        **kw: Unpack[Blocking],
    ) -> _T: ...  # fmt: skip
    @overload
    def allgatherv(
        self, x: object, counts: RowCounts | None = ..., *, out: _A | None = ...,
        **kw: Unpack[Blocking],
    ) -> _A: ...  # fmt: skip
    @overload
    def allgatherv(
        self, x: Tensor, counts: RowCounts | None = ..., *, out: _T | None = ...,
        **kw: Unpack[Async],
    ) -> Work[_T]: ...  # fmt: skip
    @overload
    def allgatherv(
        self, x: object, counts: RowCounts | None = ..., *, out: _A | None = ...,
        **kw: Unpack[Async],
    ) -> Work[_A]: ...  # fmt: skip
    @overload
    def allgatherv(
        self, x: object, counts: RowCounts | None = ..., *, out: object = ...,
        **kw: Unpack[Either],
    ) -> Any: ...  # fmt: skip
    def allgatherv(
        self,
        x: Any,
        counts: RowCounts | None = None,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's rows on every rank, concatenated in rank order (MPI_Allgatherv).

        Example with 3 ranks, ``counts=[2, 0, 1]``::

            rank 0: x = [[1, 2], [3, 4]]   rank 1: x of shape (0, 2)   rank 2: x = [[5, 6]]
            comm.allgatherv(x, [2, 0, 1])  ->  [[1, 2], [3, 4], [5, 6]] on every rank

        Args:
            x: this rank's ``counts[rank]`` rows (axis 0); the shape of a row
                (``x.shape[1:]``) and the dtype are the same on every rank.
            counts: rows per rank, the same on every rank. None on every rank:
                learn them with one allgather of an int64 per rank first.
            out: where to write the result, shape ``(sum(counts), *x.shape[1:])``.
            algorithm: ``"auto"`` (ring) or a name from ``plait.algorithms("allgatherv")``.

        Returns:
            One array of ``sum(counts)`` rows, bit-identical on every rank; rank
            q's rows start at ``plait.collectives.displacements(counts)[q]``, so
            ``np.split(result, np.cumsum(counts)[:-1])`` gives the per-rank list.
        """
        t = _ALLGATHERV
        c = t.name
        r = self._rank
        a = as_array(x, "x", r, c)
        if counts is not None:
            rows = check_counts(counts, self._size, "counts", r, c)
            check_rows(a.shape, rows[r], f"counts[{r}]", r, c)
            return self._uneven(
                t, a, a.dtype, a.shape[1:], rows, sum(rows), None, 0, x, out, algorithm,
                timeout, async_op,
            )  # fmt: skip
        check_rows(a.shape, a.shape[0] if a.shape else 0, "x.shape[0]", r, c)  # refuses 0-d
        self._check_algorithm(c, algorithm)

        def finish(got: np.ndarray) -> Any:
            rows = tuple(got.tolist())
            return self._uneven(
                t, a, a.dtype, a.shape[1:], rows, sum(rows), None, 0, x, out, algorithm,
                timeout, False,
            )  # fmt: skip

        mine = np.array(a.shape[0], np.int64)
        return self._after_exchange(
            c, lambda: self.allgather(mine, timeout=timeout), finish, async_op
        )

    @overload
    def gatherv(
        self, x: Tensor, counts: RowCounts | None = ..., root: int = ..., *,
        out: _T | None = ..., **kw: Unpack[Blocking],
    ) -> _T | None: ...  # fmt: skip
    @overload
    def gatherv(
        self, x: object, counts: RowCounts | None = ..., root: int = ..., *,
        out: _A | None = ..., **kw: Unpack[Blocking],
    ) -> _A | None: ...  # fmt: skip
    @overload
    def gatherv(
        self, x: Tensor, counts: RowCounts | None = ..., root: int = ..., *,
        out: _T | None = ..., **kw: Unpack[Async],
    ) -> Work[_T | None]: ...  # fmt: skip
    @overload
    def gatherv(
        self, x: object, counts: RowCounts | None = ..., root: int = ..., *,
        out: _A | None = ..., **kw: Unpack[Async],
    ) -> Work[_A | None]: ...  # fmt: skip
    @overload
    def gatherv(
        self, x: object, counts: RowCounts | None = ..., root: int = ..., *,
        out: object = ..., **kw: Unpack[Either],
    ) -> Any: ...  # fmt: skip
    def gatherv(
        self,
        x: Any,
        counts: RowCounts | None = None,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Gather every rank's rows on root, concatenated in rank order (MPI_Gatherv).

        Every rank passes its ``x`` of ``counts[rank]`` rows. ``counts``: rows
        per rank, the same on every rank, or None on every rank to learn them
        with one allgather of an int64 per rank first (every rank, not only
        root, needs them: a binomial tree forwards whole subtrees). Returns
        ``sum(counts)`` rows on root (``out`` if given) and None elsewhere;
        ``algorithm``: ``"auto"`` (binomial) or ``"direct"``.
        """
        t = _GATHERV
        c = t.name
        r = self._rank
        a = as_array(x, "x", r, c)
        check_root(root, r, self._size, c)

        def start(rows: tuple[int, ...], async_op: bool) -> Any:
            total = sum(rows) if r == root else None
            return self._uneven(
                t, a, a.dtype, a.shape[1:], rows, total, None, root, x, out, algorithm,
                timeout, async_op,
            )  # fmt: skip

        if counts is not None:
            rows = check_counts(counts, self._size, "counts", r, c)
            check_rows(a.shape, rows[r], f"counts[{r}]", r, c)
            return start(rows, async_op)
        check_rows(a.shape, a.shape[0] if a.shape else 0, "x.shape[0]", r, c)
        self._check_algorithm(c, algorithm)
        mine = np.array(a.shape[0], np.int64)
        return self._after_exchange(
            c,
            lambda: self.allgather(mine, timeout=timeout),
            lambda got: start(tuple(got.tolist()), False),
            async_op,
        )

    @overload
    def scatterv(
        self, x: Tensor, counts: RowCounts | None = ..., root: int = ..., *,
        out: _T | None = ..., **kw: Unpack[Blocking],
    ) -> _T: ...  # fmt: skip
    @overload
    def scatterv(
        self, x: object, counts: RowCounts | None = ..., root: int = ..., *,
        out: _A | None = ..., **kw: Unpack[Blocking],
    ) -> _A: ...  # fmt: skip
    @overload
    def scatterv(
        self, x: Tensor, counts: RowCounts | None = ..., root: int = ..., *,
        out: _T | None = ..., **kw: Unpack[Async],
    ) -> Work[_T]: ...  # fmt: skip
    @overload
    def scatterv(
        self, x: object, counts: RowCounts | None = ..., root: int = ..., *,
        out: _A | None = ..., **kw: Unpack[Async],
    ) -> Work[_A]: ...  # fmt: skip
    @overload
    def scatterv(
        self, x: object, counts: RowCounts | None = ..., root: int = ..., *,
        out: object = ..., **kw: Unpack[Either],
    ) -> Any: ...  # fmt: skip
    def scatterv(
        self,
        x: Any,
        counts: RowCounts | None = None,
        root: int = 0,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Split root's rows by ``counts``; rank r gets ``counts[r]`` rows (MPI_Scatterv).

        On root, ``x`` has ``sum(counts)`` rows and ``counts`` is required;
        elsewhere ``counts`` is ignored, as MPI's sendcounts are, and ``x`` is
        an array whose rows have root's shape and dtype (any number of rows;
        the contents are not read), or None with ``out=``. Root sends the
        counts first, one broadcast of an int64 per rank, since every rank's
        schedule needs them all. Returns this rank's ``counts[r]`` rows;
        ``algorithm``: ``"auto"`` (binomial) or ``"direct"``.
        """
        t = _SCATTERV
        c = t.name
        r = self._rank
        size = self._size
        check_root(root, r, size, c)
        is_root = r == root
        a: np.ndarray | None
        if x is None and not is_root:
            if out is None:
                raise ValueError(
                    f"rank {r}: {c}: pass x (rows of root's shape) or out= on non-root"
                )
            o = as_writable(out, "out", r, c)
            check_rows(o.shape, o.shape[0] if o.shape else 0, "out.shape[0]", r, c)
            rest, dtype, a = tuple(o.shape[1:]), o.dtype, None
            check_dtype(dtype)
        else:
            a = as_array(x, "x", r, c)
            check_rows(a.shape, a.shape[0] if a.shape else 0, "x.shape[0]", r, c)
            rest, dtype = tuple(a.shape[1:]), a.dtype
        if is_root:
            if counts is None:
                raise ValueError(f"rank {r}: {c}: root must pass counts (rows per rank)")
            assert a is not None
            rows = check_counts(counts, size, "counts", r, c)
            check_rows(a.shape, sum(rows), "sum(counts)", r, c)
            table = np.array(rows, np.int64)
        else:
            table = np.zeros(size, np.int64)
        self._check_algorithm(c, algorithm)

        def finish(got: np.ndarray) -> Any:
            rows = tuple(got.tolist())
            inp = a if is_root else None
            return self._uneven(
                t, inp, dtype, rest, rows, rows[r], None, root, x, out, algorithm, timeout, False
            )

        return self._after_exchange(
            c, lambda: self.broadcast(table, root, timeout=timeout), finish, async_op
        )

    @overload
    def alltoallv(
        self, x: Tensor, send_counts: RowCounts, recv_counts: RowCounts | None = ..., *,
        out: _T | None = ..., **kw: Unpack[Blocking],
    ) -> _T: ...  # fmt: skip
    @overload
    def alltoallv(
        self, x: object, send_counts: RowCounts, recv_counts: RowCounts | None = ..., *,
        out: _A | None = ..., **kw: Unpack[Blocking],
    ) -> _A: ...  # fmt: skip
    @overload
    def alltoallv(
        self, x: Tensor, send_counts: RowCounts, recv_counts: RowCounts | None = ..., *,
        out: _T | None = ..., **kw: Unpack[Async],
    ) -> Work[_T]: ...  # fmt: skip
    @overload
    def alltoallv(
        self, x: object, send_counts: RowCounts, recv_counts: RowCounts | None = ..., *,
        out: _A | None = ..., **kw: Unpack[Async],
    ) -> Work[_A]: ...  # fmt: skip
    @overload
    def alltoallv(
        self, x: object, send_counts: RowCounts, recv_counts: RowCounts | None = ..., *,
        out: object = ..., **kw: Unpack[Either],
    ) -> Any: ...  # fmt: skip
    def alltoallv(
        self,
        x: Any,
        send_counts: RowCounts,
        recv_counts: RowCounts | None = None,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Exchange uneven blocks of rows: ``send_counts[j]`` rows go to rank j (MPI_Alltoallv).

        torch's ``all_to_all_single`` with split sizes: ``x`` has
        ``sum(send_counts)`` rows, block j (from ``sum(send_counts[:j])`` on)
        for rank j. The schedules and the check word need the whole matrix,
        so the ranks first allgather their ``send_counts`` and
        ``recv_counts`` (2·size int64 per rank); ``recv_counts``, if given,
        is checked against what the others send, on every rank alike
        (ValueError everywhere naming the ranks whose counts disagree).
        Returns the blocks received, in rank order: ``sum(recv_counts)`` rows.
        """
        t = _ALLTOALLV
        c = t.name
        r = self._rank
        size = self._size
        a = as_array(x, "x", r, c)
        send = check_counts(send_counts, size, "send_counts", r, c)
        check_rows(a.shape, sum(send), "sum(send_counts)", r, c)
        recv = None
        if recv_counts is not None:
            recv = check_counts(recv_counts, size, "recv_counts", r, c)
        self._check_algorithm(c, algorithm)
        mine = np.array([*send, *(recv if recv is not None else (-1,) * size)], np.int64)

        def finish(table: np.ndarray) -> Any:
            m = table[:, :size]  # m[i, j]: rows rank i sends rank j
            bad = [
                q
                for q in range(size)
                if table[q, size] >= 0 and not np.array_equal(table[q, size:], m[:, q])
            ]
            if bad:
                raise ValueError(
                    f"rank {r}: {c}: recv_counts disagree with what the others send on ranks "
                    + ", ".join(
                        f"{q} (recv_counts {table[q, size:].tolist()}, sent {m[:, q].tolist()})"
                        for q in bad
                    )
                )
            rows = tuple(m.reshape(-1).tolist())
            return self._uneven(
                t, a, a.dtype, a.shape[1:], rows, int(m[:, r].sum()), None, 0, x, out,
                algorithm, timeout, False,
            )  # fmt: skip

        return self._after_exchange(
            c, lambda: self.allgather(mine, timeout=timeout), finish, async_op
        )
