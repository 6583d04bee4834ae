"""The uneven collectives of :class:`plait.Communicator`: per-rank row counts.

allgatherv, gatherv, scatterv, alltoallv and ``reduce_scatter(counts=)``
(docs/mpi.md, "Uneven collectives") count rows along axis 0 and share
``UnevenMethods._uneven``, which turns the rows into the element counts the
plan, the schedule and the check word carry. Every rank needs every count,
so where a caller cannot give them all (gatherv or allgatherv without counts,
scatterv off root, alltoallv's matrix) the call first learns them with one
small even collective (``_after_exchange``); docs/mpi.md says what each costs.

They are a mixin on top of the even collectives
(:class:`plait._edge.CollectiveMethods`), which the count exchanges call, and
they follow the same recipe: check, choose, request, start. Their overloads
read the types of :mod:`plait._edge_types`, as the even ones do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from plait import collectives
from plait._checks import (
    as_array,
    as_writable,
    check_async,
    check_counts,
    check_op,
    check_out,
    check_root,
    check_rows,
    check_timeout,
)
from plait._edge import CollectiveMethods
from plait._request import finished
from plait.collectives import Collective
from plait.ops import Op, check_dtype
from plait.runtime.work import Work

if TYPE_CHECKING:
    from typing import Unpack

    from torch import Tensor

    from plait._edge_types import _A, _T, Async, Blocking, Either, RowCounts

__all__ = ["UnevenMethods"]

_ALLGATHERV = collectives.get("allgatherv")
_GATHERV = collectives.get("gatherv")
_SCATTERV = collectives.get("scatterv")
_ALLTOALLV = collectives.get("alltoallv")
_REDUCE_SCATTERV = collectives.get("reduce_scatterv")
_ALLGATHER = collectives.get("allgather")
_BROADCAST = collectives.get("broadcast")

#: ``auto`` for the uneven collectives: ``(mean block bytes, commutative) -> algorithm``.
#: A fixed map, not :data:`plait.selection.select.RULES` (what the bench, the tuner, the
#: rules file and PLAIT_ALGO cover: the even collectives, measured), until they are measured:
#: each takes its even twin's all-round choice. reduce_scatterv keeps rank order (pairwise,
#: any op) up to 64 KiB blocks and, for a commutative op, moves large blocks by ring.
#: ``Communicator._choose`` reads it.
_UNEVEN_AUTO: dict[str, Callable[[int, bool], str]] = {
    "allgatherv": lambda nbytes, commutative: "ring",
    "gatherv": lambda nbytes, commutative: "binomial",
    "scatterv": lambda nbytes, commutative: "binomial",
    "alltoallv": lambda nbytes, commutative: "pairwise",
    "reduce_scatterv": lambda nbytes, commutative: (
        "ring" if commutative and nbytes >= 64 << 10 else "pairwise"
    ),
}


class UnevenMethods(CollectiveMethods):
    """The uneven collectives, on top of the even ones they exchange counts with."""

    def _within(
        self,
        t: Collective,
        x: np.ndarray,
        purpose: str,
        timeout: float | None,
        op: Op | None = None,
        root: int = 0,
    ) -> Any:
        """Even collective ``t`` of ``x`` as part of plait's own call ``purpose`` (its
        name): it matches only the same part of the same call on the other ranks (Note
        [calls within calls] in :mod:`plait._request`). A broadcast fills ``x``; the others
        return a new array. The count exchanges, the object collectives and ``split`` make
        their inner calls with it."""
        runner = self._runner
        if t.fills_x:  # (broadcast's long path looks up no kept request: timeout may be None)
            key: tuple[Any, ...] = (t.name, x.shape, x.dtype, root, "auto", purpose)
        else:  # as _collective keeps them, with the purpose last
            key = (t.name, x.shape, x.dtype, op, root, None, "auto", purpose)
        cut = self._shortcuts.get(key) if timeout is None and runner.plain else None
        if cut is not None and x.flags.carray:  # contiguous, aligned, writeable
            req = cut.request_fill(x) if t.fills_x else cut.request(x, False)
            return runner.start(req, None, False, self)
        if t.fills_x:
            return self._fill(x, root, "auto", timeout, False, purpose)
        # A timeout keeps _collective from looking up the user's kept requests.
        seconds = runner.timeout if timeout is None else timeout
        return self._collective(t, x, op, root, None, "auto", seconds, False, purpose)

    def _reduce_scatterv(
        self,
        x: Any,
        op: Op,
        counts: RowCounts,
        out: Any,
        algorithm: Any,
        timeout: float | None,
        async_op: bool,
    ) -> Any:
        """``reduce_scatter(counts=...)``: every rank passes the same counts, so no exchange."""
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
        purpose: str = "",
        exchanged: bool = False,
    ) -> Any:
        """Start an uneven call whose arguments are checked and whose ``rows`` every rank knows.

        ``rows``: rows per rank (alltoallv: the size×size matrix, row-major);
        ``rest``: the shape of one row; ``out_rows``: the rows of this rank's
        result, None where it gets none (gatherv off root). The counts go
        below as element counts of the flat buffers, into the plan's key and
        the check word with the shape of a row (and the row counts, where a
        row holds no element), so ranks that disagree on a count, or on the
        shape of a row, fail with MismatchError instead of misreading each
        other or returning results of different shapes.
        ``purpose``: the plait call this one is part of (``_within`` says why).
        ``exchanged``: the counts came from a count exchange just made (Note [a share
        learned too late]).
        """
        size = self._size
        row = math.prod(rest)
        has_out = out_rows is not None
        shape = (out_rows or 0, *rest)
        wrong = None
        try:
            said = "reduce_scatter" if t is _REDUCE_SCATTERV else t.name  # the user's call
            out_arr = check_out(out, shape, dtype, self._rank, said) if has_out else None
        except ValueError as exc:
            if not exchanged:
                raise
            wrong, out, out_arr = exc, None, None
        elems = tuple(k * row for k in rows)
        # The element counts say neither the shape of a row nor, where a row holds nothing,
        # how many rows: the check word covers both (ranks disagreeing raise MismatchError).
        # (A mismatch shows the rows, worked out from the counts: _signature.signature.)
        layout = f"rows {list(rows)} of shape {rest}" if row == 0 else f"row shape {rest}"
        nbytes = (
            t.uneven_whole(size, elems) * dtype.itemsize // size
        )  # auto sizes by the mean block
        choice = self._choose(t.name, algorithm, nbytes, op)
        req = self._stage.request(
            choice, 0, inp, out_arr, shape, op, root=root, has_out=has_out,
            dtype=dtype, src=x, dst=out, counts=elems, purpose=purpose, rows=layout,
        )  # fmt: skip
        # 4: the user's frame is beyond this one and the collective method's (further out
        # for reduce_scatter(counts=) and the object collectives: the recorder walks on)
        res = self._runner.start(req, timeout, async_op, self, 4)
        if wrong is not None:
            raise ValueError(
                f"{wrong}: the counts the ranks exchanged give this rank {out_rows} "
                f"row(s); it took part in {t.name} with memory of its own, so the other "
                "ranks have their results, and out was not written"
            ) from None
        return res if req.finish is None else finished(res, req.finish, async_op)

    # Note [a share learned too late]
    #     Where the counts are exchanged first, a rank learns how many rows its out must
    #     have only after the exchange; everything else about out is refused before it
    #     (_check_out_rows). A wrong row count then raised ValueError on this rank alone,
    #     and the others went on into the call: they waited for it until the timeout, or
    #     met its next call (MismatchError), and every rank's communicator broke. So a
    #     rank whose out has the wrong rows takes part with memory of its own (out=None)
    #     and raises once the call is done: the others' results are right, out is not
    #     touched, and every communicator stays usable (as MPI's truncation error is the
    #     receiving rank's alone).

    def _check_algorithm(self, c: str, algorithm: Any) -> None:
        """Refuse a bad ``algorithm=`` before a count exchange, not after it (on one rank)."""
        if algorithm != "auto":
            self._choose(c, algorithm, 0, None)

    def _check_out_rows(self, out: Any, dtype: np.dtype, rest: tuple[int, ...], c: str) -> None:
        """Refuse a bad ``out=`` before a count exchange: everything but its row count.

        Its type, dtype, writability, own memory and the shape of a row are known
        before the counts are; only how many rows it must have waits for them (a
        wrong row count is refused after the exchange: Note [a share learned too late]).
        """
        if out is None:
            return
        r = self._rank
        o = out if isinstance(out, np.ndarray) else as_writable(out, "out", r, c, contents=False)
        if o.ndim == 0:
            raise ValueError(f"rank {r}: {c}: out must have at least one dimension (rows)")
        check_out(o, (o.shape[0], *rest), dtype, r, c)

    def _after_exchange(
        self,
        c: str,
        exchange: Callable[[], np.ndarray],
        finish: Callable[[np.ndarray], Any],
        async_op: bool,
        timeout: float | None,
    ) -> Any:
        """Exchange counts (one small collective), then make the call (``finish``, one more).

        With ``async_op`` both run on the worker thread; their sequence numbers
        are reserved now, in call order, as a compressed allreduce's are, so
        calls made meanwhile cannot take their places. ``async_op`` and ``timeout``
        are checked first: the worker would meet a bad one after the exchange.
        """
        where = f"rank {self._rank}: {c}"
        if async_op is not False and async_op is not True:
            async_op = check_async(async_op, where)
        if timeout is not None:
            check_timeout(timeout, where)
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
        self._check_out_rows(out, a.dtype, a.shape[1:], c)

        def finish(got: np.ndarray) -> Any:
            rows = tuple(got.tolist())
            return self._uneven(
                t, a, a.dtype, a.shape[1:], rows, sum(rows), None, 0, x, out, algorithm,
                timeout, False, exchanged=True,
            )  # fmt: skip

        mine = np.array(a.shape[0], np.int64)
        return self._after_exchange(
            c, lambda: self._within(_ALLGATHER, mine, c, timeout), finish, async_op, timeout
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
        root = check_root(root, r, self._size, c)

        def start(rows: tuple[int, ...], async_op: bool, exchanged: bool = False) -> Any:
            total = sum(rows) if r == root else None
            return self._uneven(
                t, a, a.dtype, a.shape[1:], rows, total, None, root, x, out, algorithm,
                timeout, async_op, exchanged=exchanged,
            )  # fmt: skip

        if counts is not None:
            rows = check_counts(counts, self._size, "counts", r, c)
            check_rows(a.shape, rows[r], f"counts[{r}]", r, c)
            return start(rows, async_op)
        check_rows(a.shape, a.shape[0] if a.shape else 0, "x.shape[0]", r, c)
        self._check_algorithm(c, algorithm)
        if r == root:  # out is ignored off root
            self._check_out_rows(out, a.dtype, a.shape[1:], c)
        mine = np.array(a.shape[0], np.int64)
        return self._after_exchange(
            c,
            lambda: self._within(_ALLGATHER, mine, c, timeout),
            lambda got: start(tuple(got.tolist()), False, exchanged=True),
            async_op,
            timeout,
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
        root = check_root(root, r, size, c)
        is_root = r == root
        a: np.ndarray | None
        if x is None and not is_root:
            if out is None:
                raise ValueError(
                    f"rank {r}: {c}: pass x (rows of root's shape) or out= on non-root"
                )
            o = as_writable(out, "out", r, c, contents=False)
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
        self._check_out_rows(out, dtype, rest, c)

        def finish(got: np.ndarray) -> Any:
            rows = tuple(got.tolist())
            inp = a if is_root else None
            return self._uneven(
                t, inp, dtype, rest, rows, rows[r], None, root, x, out, algorithm, timeout,
                False, exchanged=True,
            )  # fmt: skip

        return self._after_exchange(
            c,
            lambda: self._within(_BROADCAST, table, c, timeout, root=root),
            finish,
            async_op,
            timeout,
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
        self._check_out_rows(out, a.dtype, a.shape[1:], c)
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
                algorithm, timeout, False, exchanged=True,
            )  # fmt: skip

        return self._after_exchange(
            c, lambda: self._within(_ALLGATHER, mine, c, timeout), finish, async_op, timeout
        )
