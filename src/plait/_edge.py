"""The collectives of :class:`plait.Communicator`: check the arguments, request, start.

Every collective follows one recipe: check its arguments (:mod:`plait._checks`),
choose the algorithm (``Communicator._choose``), turn the call into an
immutable request (:class:`plait._request.Stager`) and hand it to the call
runner (:class:`plait._runner.CallRunner`), which returns the result or, with
``async_op=True``, a :class:`plait.Work`. :class:`CollectiveMethods` holds them so
that :mod:`plait.communicator` keeps the communicator's own life (identity,
groups, point to point, algorithm choice).

Typing (see Note [result types] in :mod:`plait.communicator`): a torch tensor
``x`` gives a tensor, anything else a numpy array, ``out=`` gives ``out``
itself (the type variables' defaults say which applies when ``out`` is
omitted); ``async_op=True`` gives a :class:`plait.Work` of that; a plain
``bool`` for ``async_op`` gives either, so it is typed ``Any``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

import numpy as np

from plait._checks import as_array, check_op, check_out, check_root, split_rows
from plait.ops import SUM, Op, check_dtype

if TYPE_CHECKING:
    from typing import Literal, NotRequired, TypedDict, Unpack

    from numpy.typing import NDArray
    from torch import Tensor
    from typing_extensions import TypeVar

    from plait._request import Stager
    from plait._runner import CallRunner
    from plait.compression.base import Compressor
    from plait.runtime.work import Work
    from plait.selection.select import Choice

    #: The result for a tensor ``x``: ``out``'s type when given, else a tensor.
    _T = TypeVar("_T", default=Tensor)
    #: The result for any other ``x``: ``out``'s type when given, else a numpy array.
    _A = TypeVar("_A", default=NDArray[Any])
    #: What broadcast fills and returns: ``x`` itself.
    _X = TypeVar("_X")

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

        compression: Compressor | None

    class CompressedAsync(Async, total=False):
        """allreduce's async options, with ``compression=``."""

        compression: Compressor | None

    class CompressedEither(Either, total=False):
        """allreduce's options for a run-time ``async_op``, with ``compression=``."""

        compression: Compressor | None


__all__ = ["CollectiveMethods"]


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
        compression: Compressor,
    ) -> Any:
        """``allreduce(compression=...)`` (defined by the communicator)."""
        raise NotImplementedError

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
        compression: Compressor | None = None,
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
        c = "allreduce"
        a = as_array(x, "x", self._rank, c)
        check_op(op, a.dtype, self._rank, c, self._checked)
        out_arr = check_out(out, a.shape, a.dtype, self._rank, c)
        choice = self._choose(c, algorithm, a.nbytes, op)
        req = self._stage.request(choice, a.size, a, out_arr, a.shape, op, src=x, dst=out)
        return self._runner.start(req, timeout, async_op, self)

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
        c = "reduce"
        a = as_array(x, "x", self._rank, c)
        check_root(root, self._rank, self._size, c)
        check_op(op, a.dtype, self._rank, c, self._checked)
        is_root = self._rank == root
        out_arr = check_out(out, a.shape, a.dtype, self._rank, c) if is_root else None
        choice = self._choose(c, algorithm, a.nbytes, op)
        req = self._stage.request(
            choice, a.size, a, out_arr, a.shape, op, root=root, has_out=is_root, src=x, dst=out
        )
        return self._runner.start(req, timeout, async_op, self)

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
        a = as_array(x, "x", self._rank, c)
        check_root(root, self._rank, self._size, c)
        if self._rank != root and not a.flags.writeable:
            raise ValueError(f"rank {self._rank}: {c}: x is read-only; it receives root's data")
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._stage.request(choice, a.size, None, a, a.shape, None, root=root, result=x)
        return self._runner.start(req, timeout, async_op, self)

    @overload
    def reduce_scatter(
        self, x: Tensor, op: Op = ..., *, out: _T | None = ..., **kw: Unpack[Blocking]
    ) -> _T: ...
    @overload
    def reduce_scatter(
        self, x: object, op: Op = ..., *, out: _A | None = ..., **kw: Unpack[Blocking]
    ) -> _A: ...
    @overload
    def reduce_scatter(
        self, x: Tensor, op: Op = ..., *, out: _T | None = ..., **kw: Unpack[Async]
    ) -> Work[_T]: ...
    @overload
    def reduce_scatter(
        self, x: object, op: Op = ..., *, out: _A | None = ..., **kw: Unpack[Async]
    ) -> Work[_A]: ...
    @overload
    def reduce_scatter(
        self, x: object, op: Op = ..., *, out: object = ..., **kw: Unpack[Either]
    ) -> Any: ...
    def reduce_scatter(
        self,
        x: Any,
        op: Op = SUM,
        *,
        out: Any = None,
        algorithm: str = "auto",
        timeout: float | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce over ranks, then split: rank r gets rows ``r*k:(r+1)*k`` of the result.

        Axis 0 of ``x`` must have ``size * k`` rows; the result has shape
        ``(k, *x.shape[1:])``.
        """
        c = "reduce_scatter"
        a = as_array(x, "x", self._rank, c)
        check_op(op, a.dtype, self._rank, c, self._checked)
        rows = split_rows(a.shape, self._rank, self._size, c)
        shape = (rows, *a.shape[1:])
        out_arr = check_out(out, shape, a.dtype, self._rank, c)
        choice = self._choose(c, algorithm, a.nbytes // self._size, op)
        req = self._stage.request(
            choice, a.size // self._size, a, out_arr, shape, op, src=x, dst=out
        )
        return self._runner.start(req, timeout, async_op, self)

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
        c = "allgather"
        a = as_array(x, "x", self._rank, c)
        shape = (self._size, *a.shape)
        out_arr = check_out(out, shape, a.dtype, self._rank, c)
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._stage.request(choice, a.size, a, out_arr, shape, None, src=x, dst=out)
        return self._runner.start(req, timeout, async_op, self)

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
        c = "alltoall"
        a = as_array(x, "x", self._rank, c)
        split_rows(a.shape, self._rank, self._size, c)
        out_arr = check_out(out, a.shape, a.dtype, self._rank, c)
        choice = self._choose(c, algorithm, a.nbytes // self._size, None)
        req = self._stage.request(
            choice, a.size // self._size, a, out_arr, a.shape, None, src=x, dst=out
        )
        return self._runner.start(req, timeout, async_op, self)

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
        c = "gather"
        a = as_array(x, "x", self._rank, c)
        check_root(root, self._rank, self._size, c)
        shape = (self._size, *a.shape)
        is_root = self._rank == root
        out_arr = check_out(out, shape, a.dtype, self._rank, c) if is_root else None
        choice = self._choose(c, algorithm, a.nbytes, None)
        req = self._stage.request(
            choice, a.size, a, out_arr, shape, None, root=root, has_out=is_root, src=x, dst=out
        )
        return self._runner.start(req, timeout, async_op, self)

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
        c = "scatter"
        r = self._rank
        check_root(root, r, self._size, c)
        is_root = r == root
        if x is None and not is_root:
            if out is None:
                raise ValueError(
                    f"rank {r}: {c}: pass x (root's shape and dtype) or out= on non-root"
                )
            o = as_array(out, "out", r, c)
            shape: tuple[int, ...] = tuple(o.shape)
            if not shape:
                raise ValueError(f"rank {r}: {c}: out must have at least one dimension")
            dtype = o.dtype
            check_dtype(dtype)
            a = np.empty(0, dtype)
        else:
            a = as_array(x, "x", r, c)
            rows = split_rows(a.shape, r, self._size, c)
            shape = (rows, *a.shape[1:])
            dtype = a.dtype
        out_arr = check_out(out, shape, dtype, r, c)
        count = int(np.prod(shape, dtype=np.int64))
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
