"""The even collectives of :class:`plait.Communicator`: check the arguments, request, start.

Every collective follows one recipe: check its arguments (:mod:`plait._checks`), choose the
algorithm (``Communicator._choose``), turn the call into an immutable request
(:class:`plait._request.Stager`) and hand it to the call runner
(:class:`plait._runner.CallRunner`), which returns the result or, with ``async_op=True``, a
:class:`plait.Work`. :class:`CollectiveMethods` holds them so that :mod:`plait.communicator`
keeps the communicator's own life (identity, groups, point to point, algorithm choice). Six of
them (allreduce, reduce, reduce_scatter, allgather, alltoall, gather) are that recipe and
nothing else: ``CollectiveMethods._collective`` runs it, reading what differs (root, op, blocks,
result shape, whether a rank gets a result) from their row of :data:`plait.collectives.TABLE`
rather than from their names. Broadcast (which fills ``x``), scatter (whose non-roots may pass
only ``out``) and barrier (no data) spell theirs out.

The uneven collectives (allgatherv, gatherv, scatterv, alltoallv and the ``counts=`` form of
reduce_scatter, which hands itself to ``_reduce_scatterv``) are
:class:`plait._uneven_edge.UnevenMethods`, and the object collectives
:class:`plait._object_methods.ObjectMethods`; both build on these and are mixed into the
communicator on top of them.

The overloads' types (tensor in, tensor out; ``out=`` gives ``out``;
``async_op=True`` gives a :class:`plait.Work`) are in :mod:`plait._edge_types`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from plait import collectives
from plait._arrays import immutable
from plait._checks import (
    CACHE_LIMIT,
    as_array,
    as_writable,
    check_op,
    check_out,
    check_own_memory,
    check_root,
    split_rows,
)
from plait._request import Request, Stager, finished
from plait._shortcut import Shortcut, separate
from plait.collectives import Collective
from plait.ops import SUM, Op, check_dtype

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Unpack

    from torch import Tensor

    from plait._compressed import Compression
    from plait._edge_types import (
        _A,
        _T,
        _X,
        Async,
        Blocking,
        CompressedAsync,
        CompressedBlocking,
        CompressedEither,
        Either,
        RowCounts,
    )
    from plait._runner import CallRunner
    from plait.runtime.work import Work
    from plait.selection.select import Choice


__all__ = ["CollectiveMethods"]

# Looked up once here, not per call (collectives.get costs a call and a dict lookup).
_AUTO = "auto"  # barrier's default algorithm, one object
_ALLREDUCE = collectives.get("allreduce")
_REDUCE = collectives.get("reduce")
_REDUCE_SCATTER = collectives.get("reduce_scatter")
_ALLGATHER = collectives.get("allgather")
_ALLTOALL = collectives.get("alltoall")
_GATHER = collectives.get("gather")
_SCATTER = collectives.get("scatter")


class CollectiveMethods:
    """The even collectives; :class:`plait.Communicator` provides what they use.

    That is the rank, the size, the algorithm choice ``_choose``, the compressed allreduce
    ``_allreduce_compressed``, the cache of accepted (op, dtype) pairs, the
    :class:`~plait._request.Stager` and the :class:`~plait._runner.CallRunner`;
    ``reduce_scatter(counts=)`` runs :class:`~plait._uneven_edge.UnevenMethods`'
    ``_reduce_scatterv``.
    """

    _rank: int
    _size: int
    _checked: set[tuple[Op, np.dtype]]
    _stage: Stager
    _runner: CallRunner
    _shortcuts: dict[tuple[Any, ...], Shortcut]
    # The request every plain barrier runs (made by the first), and its short path
    _barrier: tuple[Request, Callable[[Request, int], Any] | None] | None

    # Defined by the classes mixed in above: the algorithm and segment of a call (the communicator,
    # next to the settings and the cache of auto's choices it reads), ``allreduce(compression=...)``
    # (the communicator) and ``reduce_scatter(counts=...)`` (plait._uneven_edge.UnevenMethods).
    _choose: Callable[[str, Any, int, Op | None], Choice]
    _allreduce_compressed: Callable[..., Any]
    _reduce_scatterv: Callable[..., Any]

    def _keep_shortcut(self, key: tuple[Any, ...], cut: Shortcut, purpose: str = "") -> None:
        """Keep ``cut`` for the calls of ``key`` (Note [the short path]), within CACHE_LIMIT;
        an inner call's (``purpose``) apart, where only ``UnevenMethods._within`` looks."""
        if len(self._shortcuts) >= CACHE_LIMIT:
            self._shortcuts.clear()
        self._shortcuts[(*key, purpose) if purpose else key] = cut

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
        purpose: str = "",
    ) -> Any:
        """The recipe of the collectives that read ``x`` and return a new result.

        What differs between them is read from their row ``t`` of
        :data:`plait.collectives.TABLE`, not from their names: whether a root
        and an op are checked, whether axis 0 of ``x`` is cut into ``size``
        blocks, the result's shape, whether this rank gets a result at all
        (``reduce`` and ``gather`` return None off root and ignore ``out``
        there) and the call's count (one block for the block collectives),
        which also sizes the algorithm choice. ``purpose``: see ``UnevenMethods._within``.
        """
        # Note [the short path] in plait._shortcut: a repeated simple call skips the checks.
        # (Not for a compressor's calls: they choose among message algorithms only.)
        # (``type(root) is int``: True and 0.0 hash as 1 and 0 but are refused the long way)
        key = None
        runner = self._runner
        if (
            type(x) is np.ndarray
            and type(root) is int
            and (out is None or out is x or type(out) is np.ndarray)
        ):
            # What out is: none, x itself, or another array (its shape and dtype in the key).
            given: object = None if out is None else True if out is x else (out.shape, out.dtype)
            key = (t.name, x.shape, x.dtype, op, root, given, algorithm)
            fast = async_op is False and timeout is None and (runner.plain or not runner.reserved())
            try:  # (an unhashable op or algorithm: refused the long way, in words)
                cut = self._shortcuts.get(key) if fast else None
            except TypeError:
                key = cut = None
            # ``flags.carray``: contiguous, aligned and writeable in one test (an unaligned
            # array takes the long way)
            if cut is not None:
                req = None
                if given is True:
                    if x.flags.carray:
                        req = cut.request(x, True)
                elif x.flags.c_contiguous:
                    if given is None:
                        req = cut.request(x, False)
                    elif out is not None and out.flags.carray and separate(x, out):
                        req = cut.request_into(x, out)
                if req is not None:
                    go = cut.go
                    if go is not None and runner.plain:
                        return go(req, 4)  # its frame in place of start's: the same skip
                    return runner.start(req, None, False, self, 4)
        c = t.name
        r = self._rank
        size = self._size
        a = as_array(x, "x", r, c)
        if t.rooted:
            root = check_root(root, r, size, c)
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
            choice, count, a, out_arr, shape, op, root=root, has_out=has_out, src=x, dst=out,
            purpose=purpose,
        )  # fmt: skip
        if (
            key is not None
            and not self._runner.reserved()
            and x.dtype.isnative
            and req.writeback is None
            and (out is None or req.aliased or (out is not x and out.dtype == x.dtype))
            and x.flags.c_contiguous
        ):
            go = self._runner.short_path(req.plan)
            self._keep_shortcut(key, Shortcut(req, shape, has_out, x.ndim == 1, go), purpose)
        # 4: the user's frame is beyond this one and the collective method's
        res = self._runner.start(req, timeout, async_op, self, 4)
        return res if req.finish is None else finished(res, req.finish, async_op)

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
        than root it must be writeable (root only reads it: a read-only array or
        a JAX array is fine there). An array in device memory is staged through
        the host and root's data written back into it.
        """
        c = "broadcast"
        simple = (
            type(x) is np.ndarray and type(root) is int and async_op is False and timeout is None
        )
        runner = self._runner
        if simple and (runner.plain or not runner.reserved()):
            # Note [the short path] (a read-only x on root takes the long way)
            key = (c, x.shape, x.dtype, root, algorithm)
            try:  # (an unhashable algorithm: refused the long way, in words)
                cut = self._shortcuts.get(key)
            except TypeError:
                cut = None
            if cut is not None and x.flags.carray:  # contiguous, aligned, writeable
                go = cut.go
                if go is not None and runner.plain:
                    return go(cut.request_fill(x), 3)  # as start's skip
                return runner.start(cut.request_fill(x), None, False, self)
        return self._fill(x, root, algorithm, timeout, async_op, "")

    def _fill(
        self, x: Any, root: int, algorithm: Any, timeout: float | None, async_op: bool, purpose: str
    ) -> Any:
        """broadcast's long path (``purpose``: see ``UnevenMethods._within``)."""
        c = "broadcast"
        r = self._rank
        simple = (
            type(x) is np.ndarray and type(root) is int and async_op is False and timeout is None
        )
        if type(x) is not np.ndarray and r == root and immutable(x):
            a = as_array(x, "x", r, c)  # root only reads its x: a JAX array is fine there
        else:
            a = as_writable(x, "x", r, c)
        root = check_root(root, r, self._size, c)
        if r != root:
            if not a.flags.writeable:
                raise ValueError(f"rank {r}: {c}: x is read-only; it receives root's data")
            if not a.flags.c_contiguous:
                check_own_memory(a, "x", r, c)
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._stage.request(
            choice, a.size, None, a, a.shape, None, root=root, result=x, dst=x, purpose=purpose
        )
        if not a.flags.writeable and req.plan.writes_out:  # root's: its algorithm writes it
            a = np.array(a)  # so it sends from a copy, and x is only read
            req = self._stage.request(
                choice, a.size, None, a, a.shape, None, root=root, result=x, dst=x, purpose=purpose
            )
        if (
            simple
            and not self._runner.reserved()
            and x.dtype.isnative
            and req.writeback is None
            and x.flags.c_contiguous
            and x.flags.writeable
        ):
            go = self._runner.short_path(req.plan)
            cut = Shortcut(req, x.shape, True, x.ndim == 1, go)
            self._keep_shortcut((c, x.shape, x.dtype, root, algorithm), cut, purpose)
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
        return self._reduce_scatterv(x, op, counts, out, algorithm, timeout, async_op)

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
        # Note [the short path] in plait._shortcut, as in _collective.
        key = None
        runner = self._runner
        if type(x) is np.ndarray and type(root) is int and (out is None or type(out) is np.ndarray):
            key = (
                c,
                x.shape,
                x.dtype,
                root,
                None if out is None else (out.shape, out.dtype),
                algorithm,
            )
            fast = async_op is False and timeout is None and (runner.plain or not runner.reserved())
            try:  # (an unhashable algorithm: refused the long way, in words)
                cut = self._shortcuts.get(key) if fast else None
            except TypeError:
                key = cut = None
            if (
                cut is not None
                and x.flags.c_contiguous
                and (out is None or (out.flags.carray and separate(x, out)))
            ):
                req = cut.request_part(x, out)
                go = cut.go
                if go is not None and runner.plain:
                    return go(req, 3)  # as start's skip
                return runner.start(req, None, False, self)
        r = self._rank
        root = check_root(root, r, self._size, c)
        is_root = r == root
        if x is None and not is_root:
            if out is None:
                raise ValueError(
                    f"rank {r}: {c}: pass x (root's shape and dtype) or out= on non-root"
                )
            o = as_writable(out, "out", r, c, contents=False)
            shape: tuple[int, ...] = tuple(o.shape)
            if not shape:
                raise ValueError(f"rank {r}: {c}: out must have at least one dimension")
            dtype = o.dtype
            check_dtype(dtype)
            a = np.empty(0, dtype)
        else:
            if x is None:
                raise ValueError(f"rank {r}: {c}: root {root} must pass x, the array it splits")
            a = as_array(x, "x", r, c)
            split_rows(a.shape, r, self._size, c)
            shape = t.result_shape(a.shape, self._size)
            dtype = a.dtype
        out_arr = check_out(out, shape, dtype, r, c)
        count = math.prod(shape)  # t.x_count of root's x (np.prod costs 3 µs a call)
        choice = self._choose(c, algorithm, count * dtype.itemsize, None)
        inp = a if is_root else None
        req = self._stage.request(
            choice, count, inp, out_arr, shape, None, root=root, dtype=dtype, src=x, dst=out
        )
        if (
            key is not None
            and not runner.reserved()
            and dtype.isnative
            and req.writeback is None
            and req.finish is None
            and not req.aliased
            and (out is None or out.dtype == dtype)
            and x.flags.c_contiguous
        ):
            go = runner.short_path(req.plan)
            self._keep_shortcut(key, Shortcut(req, shape, True, x.ndim == 1, go))
        res = runner.start(req, timeout, async_op, self)
        return res if req.finish is None else finished(res, req.finish, async_op)

    @overload
    def barrier(self, **kw: Unpack[Blocking]) -> None: ...
    @overload
    def barrier(self, **kw: Unpack[Async]) -> Work[None]: ...
    @overload
    def barrier(self, **kw: Unpack[Either]) -> Work[None] | None: ...
    def barrier(
        self, *, algorithm: str = _AUTO, timeout: float | None = None, async_op: bool = False
    ) -> Any:
        """Return only once every rank has entered the barrier (``algorithm``: ``"auto"``
        or a name from ``plait.algorithms("barrier")``, the same on every rank)."""
        # One request serves every call of auto's choice (Note [the short path]; not a
        # compressor's, among message algorithms only). "is": the default is one object.
        runner = self._runner
        kept = self._barrier
        auto = algorithm is _AUTO
        if auto and kept is not None and runner.plain and timeout is None and async_op is False:
            req, go = kept
            if go is not None:
                return go(req, 3)  # as start's skip
            return runner.start(req, None, False, self)
        auto = auto or (type(algorithm) is str and algorithm == "auto")
        plain = not runner.reserved() and auto
        if plain and kept is not None:
            return runner.start(kept[0], timeout, async_op, self)
        choice = self._choose("barrier", algorithm, 0, None)
        empty = np.empty(0, np.uint8)
        req = self._stage.request(choice, 0, empty, None, (0,), None, has_out=False, result=None)
        if plain:
            self._barrier = (req, runner.short_path(req.plan))
        return runner.start(req, timeout, async_op, self)
