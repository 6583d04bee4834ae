"""mpi4py's buffer collectives (``Bcast``, ``Allreduce``, ``Gatherv``, ...) over plait's.

Each call reads its buffer specifications (:mod:`plait.mpi._datatypes`) and runs one plait
collective on views of the caller's memory. Data-moving collectives move the bytes of the
specified elements (a ``uint8`` view), so any datatype works, pair structs included;
reductions view the same bytes as the datatype's numpy dtype. The ``v`` collectives run
plait's uneven ones with counts in bytes; blocks whose displacements leave gaps or reorder
them are packed into (or unpacked from) a contiguous array, one copy. MAXLOC and MINLOC,
which plait's reductions do not know, allgather (or gather) the pairs and combine them in
rank order (:func:`plait.mpi._ops.combine_pairs`): ``size`` times the data, for what are
usually a few pairs. Reductions refuse, before anything moves, send and receive buffers of
two datatypes (mpi4py's ValueError) and an op the datatype does not take (Open MPI's
MPI_ERR_OP: :func:`plait.mpi._ops.check_op`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.errors import MismatchError
from plait.mpi._datatypes import IN_PLACE, Message, ints, message, vector
from plait.mpi._errors import mpi_error
from plait.mpi._ops import OPS, Op, check_op, combine_pairs, fields

if TYPE_CHECKING:
    from plait import Communicator
    from plait import ops as plait_ops

__all__ = ["BufferCollectives"]

_SUM = OPS["SUM"]


def _pack(m: Message) -> np.ndarray:
    """The blocks of a ``v`` specification back to back: a view when they already are."""
    if m.packed():
        return m.raw[: sum(m.counts) * m.extent]
    return np.concatenate([m.bytes(d, c) for c, d in zip(m.counts, m.displs, strict=True)])


def _unpack(m: Message, data: np.ndarray) -> None:
    """Copy back-to-back blocks into their places in ``m``'s buffer."""
    at = 0
    for c, d in zip(m.counts, m.displs, strict=True):
        n = c * m.extent
        m.bytes(d, c)[...] = data[at : at + n]
        at += n


def _own_block(sent: Message, r: Message, rank: int, call: str, whose: str) -> None:
    """Raise ValueError, in elements, where this rank's message ``sent`` is not the size of
    its block ``rank`` of the ``v`` specification ``r`` (``whose`` names that block), before
    any byte moves: plait's own check would say it in bytes."""
    if sent.count * sent.extent != r.counts[rank] * r.extent:
        raise ValueError(
            f"{call}: this rank's message is {sent.count} element(s) of {sent.datatype.name} "
            f"({sent.count * sent.extent} bytes), but {whose} is {r.counts[rank]} element(s) "
            f"of {r.datatype.name} ({r.counts[rank] * r.extent} bytes); they must hold the "
            "same bytes"
        )


def _same(call: str, a: Message, a_name: str, b: Message, b_name: str) -> None:
    """Raise ValueError, in elements, unless ``a`` and ``b`` (their counts: per block where
    the call splits one into blocks) hold the same bytes: plait's own check said it in
    bytes of the uint8 view, or in the names of plait's arguments (``out``, ``x``)."""
    if a.count * a.extent != b.count * b.extent:
        raise ValueError(
            f"{call}: {a_name} is {a.count} {a.datatype.name} ({a.count * a.extent} bytes) "
            f"but {b_name} is {b.count} {b.datatype.name} ({b.count * b.extent} bytes); they "
            "must hold the same bytes (MPI_ERR_TRUNCATE where the receive is shorter)"
        )


def _one_datatype(call: str, s: Message, r: Message) -> None:
    """Raise mpi4py's ValueError where a reduction's ``sendbuf`` and ``recvbuf`` name two
    datatypes, before any byte moves: MPI reduces one datatype, and two names of one C type
    (``INT`` and ``INT32_T``, ``LONG`` and ``LONG_LONG``) are two datatypes, as in mpi4py.
    plait's own check named ``out`` and numpy dtypes, and let two such names pass."""
    if s.datatype.name != r.datatype.name:
        err = ValueError("mismatch in send and receive MPI datatypes")
        err.add_note(
            f"{call}: sendbuf is {s.datatype.name} but recvbuf is {r.datatype.name}; pass "
            "one datatype for both"
        )
        raise err


def _in_elements(exc: MismatchError, call: str, what: str, m: Message, count: int) -> Exception:
    """``exc`` (ranks' calls differ: plait says this rank's in bytes of the uint8 view) with
    what this rank passed in MPI's terms: ``what`` holds ``count`` elements of ``m``'s."""
    said, _, dumped = str(exc).partition("; flight recorder dump: ")
    mine = f"{count} {m.datatype.name} ({count * m.extent} bytes)"
    text = f"{said}; in MPI's terms, this rank's {call} {what} holds {mine}"
    err = type(exc)(text + (f"; flight recorder dump: {dumped}" if dumped else ""))
    err.__dict__.update(exc.__dict__)
    return err


def _in_place(buf: Any) -> bool:
    """Whether a send buffer (root's receive buffer, for Scatter) means MPI.IN_PLACE: mpi4py
    reads a bare None so wherever the call takes IN_PLACE (``Allgatherv(None, ...)`` on a
    rank of count 0 included)."""
    return buf is IN_PLACE or buf is None


def _rank_prefix(exc: Exception) -> str:
    """``"rank 1: "`` where plait's error starts so, else ``""``."""
    found = re.match(r"rank \d+: ", str(exc))
    return found.group(0) if found else ""


def _scattered(exc: ValueError, call: str, m: Message) -> ValueError:
    """plait's error for a Scatterv ``recvbuf`` off root that is not what root sends this
    rank (plait says it in bytes of the uint8 view, as ``out``), in MPI's terms (a shorter
    one is MPI's truncation error, an ``MPI.Exception`` of class ``ERR_TRUNCATE``); other
    errors as they are. ``recvbuf`` was not written: plait took part with memory of its own.
    """
    found = re.search(r"give this rank (\d+) row", str(exc))
    if found is None:
        return exc
    nbytes, e, name = int(found.group(1)), m.extent, m.datatype.name
    held = m.count * e
    sent = f"{nbytes // e} {name}" if e and nbytes % e == 0 else f"{nbytes} bytes"
    why = "message truncated (MPI_ERR_TRUNCATE): " if nbytes > held else ""
    tail = (
        ""
        if nbytes > held
        else " (plait.mpi's Scatterv takes exactly what root sends, MPI's a longer recvbuf too)"
    )
    text = (
        f"{_rank_prefix(exc)}{call}: {why}root sends this rank {sent} ({nbytes} bytes), but "
        f"recvbuf holds {m.count} {name} ({held} bytes){tail}; recvbuf was not written, and "
        "the other ranks have their data"
    )
    return mpi_error("ERR_TRUNCATE", text) if nbytes > held else ValueError(text)


def _disagreeing(exc: ValueError, call: str, s: Message, r: Message) -> ValueError:
    """plait's error for Alltoallv recvcounts that disagree with what the ranks send (every
    rank raises it; plait counts bytes) in elements: recvcounts in this rank's recvbuf
    datatype, the counts sent in its sendbuf datatype (MPI lets ranks differ in datatypes;
    programs seldom do). Other errors as they are."""
    said = str(exc)
    bad = re.findall(r"(\d+) \(recv_counts \[([\d, ]*)\], sent \[([\d, ]*)\]\)", said)
    if "recv_counts disagree" not in said or not bad:
        return exc

    def counted(text: str, m: Message) -> str:
        nbytes = [int(v) for v in text.split(",") if v.strip()]
        e = m.extent
        if e and all(n % e == 0 for n in nbytes):
            return f"{[n // e for n in nbytes]} {m.datatype.name}"
        return f"{nbytes} bytes"

    ranks = "; ".join(
        f"rank {q}'s recvcounts are {counted(want, r)}, but the ranks send it {counted(got, s)}"
        for q, want, got in bad
    )
    return ValueError(
        f"{_rank_prefix(exc)}{call}: recvcounts disagree with the sendcounts of the ranks "
        f"that send to them: {ranks} (in elements of this rank's recvbuf and sendbuf "
        "datatypes; MPI_ERR_TRUNCATE where a receive is shorter)"
    )


def _mpi_op(op: Any, datatype: Any, call: str) -> Op:
    """``op``, checked: one of MPI's ops (TypeError), defined on ``datatype`` (MPI_ERR_OP:
    Note [ops and datatypes] in plait.mpi._ops)."""
    if not isinstance(op, Op):
        raise TypeError(
            f"{call}: op must be one of MPI's ops (MPI.SUM, MPI.MAX, ...); got {op!r} "
            f"(a Python function reduces objects: use the lowercase reduce/allreduce)"
        )
    check_op(op, datatype, call)
    return op


def _plait_op(op: Op) -> plait_ops.Op:
    assert op.plait_op is not None
    return op.plait_op


def _pairs(a: np.ndarray, call: str) -> np.ndarray:
    """MAXLOC/MINLOC operands: structured pairs as they are, plain arrays as rows of 2.

    Raises:
        TypeError: ``a`` holds no pairs (checked before the call moves a byte).
    """
    if a.dtype.names is None and a.size % 2 == 0:
        a = a.reshape(-1, 2)
    fields(a, call)  # the rule, and the message, of combine_pairs
    return a


class BufferCollectives:
    """The buffer collectives of :class:`plait.mpi.Comm` (a mixin)."""

    if TYPE_CHECKING:

        @property
        def _c(self) -> Communicator: ...

    def Barrier(self) -> None:
        """Wait until every rank has entered the barrier."""
        self._c.barrier()

    def Bcast(self, buf: Any, root: int = 0) -> None:
        """Root's ``buf`` into every rank's ``buf``."""
        m = message(buf, "Bcast", what="buf", writes=self._c.rank != root)
        try:
            self._c.broadcast(m.bytes(), root)
        except MismatchError as exc:
            raise _in_elements(exc, "Bcast", "buf", m, m.count) from exc.__cause__

    def _allreduce_into(self, x: np.ndarray, out: np.ndarray, op: Op, call: str) -> None:
        c = self._c
        if op.loc is not None:
            _pairs(x, call)
            pairs = _pairs(out, call)
            g = c.allgather(np.ascontiguousarray(x).view(np.uint8).reshape(-1))
            blocks = [_pairs(row.view(x.dtype), call) for row in g]
            combine_pairs(blocks, op.loc, pairs, call)
        else:
            c.allreduce(x, _plait_op(op), out=out)

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = _SUM) -> None:
        """Reduce every rank's ``sendbuf`` with ``op`` into every rank's ``recvbuf``."""
        call = "Allreduce"
        r = message(recvbuf, call, what="recvbuf")
        out = r.typed()
        if _in_place(sendbuf):
            x = out
        else:
            s = message(sendbuf, call, what="sendbuf")
            _one_datatype(call, s, r)
            _same(call, s, "sendbuf", r, "recvbuf")
            x = s.typed()
        self._allreduce_into(x, out, _mpi_op(op, r.datatype, call), call)

    def Reduce(self, sendbuf: Any, recvbuf: Any, op: Any = _SUM, root: int = 0) -> None:
        """Reduce every rank's ``sendbuf`` with ``op`` into root's ``recvbuf``.

        Root's ``sendbuf`` and ``recvbuf`` must be of one datatype and size, as mpi4py
        checks them (Note [a Reduce that root refuses]).

        Note [a Reduce that root refuses]
            mpi4py checks the buffers at root only, and raises ValueError there before
            MPI_Reduce; the other ranks' reduce completes without root (their part is
            sent), and their next calls go on. plait.mpi's root refused before the call
            too, and the others then waited for it in a reduce it never joined, their
            communicator broken by the next call. Root now takes part with its
            ``sendbuf`` (what the others reduce with), into memory of its own, and raises
            once the call is done, ``recvbuf`` not written: the others get what mpi4py's
            do, and the communicator stays usable. Where the op itself is refused (the
            others raise MPI_ERR_OP without a call), root raises at once.
        """
        call = "Reduce"
        c = self._c
        is_root = c.rank == root
        r = message(recvbuf, call, what="recvbuf") if is_root else None
        out = r.typed() if r is not None else None
        refused: ValueError | None = None
        if sendbuf is IN_PLACE or (sendbuf is None and is_root):
            if out is None:
                raise ValueError(f"{call}: MPI.IN_PLACE is for root's send buffer only")
            x = out
        else:
            s = message(sendbuf, call, what="sendbuf")
            if r is not None:  # mpi4py checks root's buffers only
                try:
                    _one_datatype(call, s, r)
                    _same(call, s, "sendbuf", r, "root's recvbuf")
                except ValueError as exc:  # Note [a Reduce that root refuses]
                    refused, r, out = exc, None, None
            x = s.typed()
        try:
            op = _mpi_op(op, r.datatype if r is not None else s.datatype, call)
        except (TypeError, ValueError):
            if refused is not None:
                raise refused from None
            raise
        if op.loc is not None:
            _pairs(x, call)
            pairs = _pairs(out, call) if out is not None else None
            g = c.gather(np.ascontiguousarray(x).view(np.uint8).reshape(-1), root)
            if pairs is not None and g is not None:
                blocks = [_pairs(row.view(x.dtype), call) for row in g]
                combine_pairs(blocks, op.loc, pairs, call)
        else:
            c.reduce(x, root, _plait_op(op), out=out)
        if refused is not None:
            refused.add_note(
                f"{call}: root took part with its sendbuf and wrote nothing into recvbuf; "
                "the other ranks have completed"
            )
            raise refused

    def Gather(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Every rank's ``sendbuf`` into root's ``recvbuf``, in rank order."""
        call = "Gather"
        c = self._c
        size = c.size
        out = None
        if c.rank == root:
            r = message(recvbuf, call, blocks=size, what="recvbuf")
            nb = r.count * r.extent
            out = r.bytes(r.displs[0], r.count * size).reshape(size, nb)
            if _in_place(sendbuf):
                x = out[root].copy()
            else:
                s = message(sendbuf, call, what="sendbuf")
                _same(call, s, "sendbuf", r, "each block of root's recvbuf")
                x = s.bytes()
        else:
            s = message(sendbuf, call, what="sendbuf")
            x = s.bytes()
        try:
            c.gather(x, root, out=out)
        except MismatchError as exc:
            if out is not None and _in_place(sendbuf):
                raise
            raise _in_elements(exc, call, "sendbuf", s, s.count) from exc.__cause__

    def Allgather(self, sendbuf: Any, recvbuf: Any) -> None:
        """Every rank's ``sendbuf`` into every rank's ``recvbuf``, in rank order."""
        call = "Allgather"
        c = self._c
        r = message(recvbuf, call, blocks=c.size, what="recvbuf")
        out = r.bytes(r.displs[0], r.count * c.size).reshape(c.size, r.count * r.extent)
        if _in_place(sendbuf):
            x = out[c.rank].copy()
        else:
            s = message(sendbuf, call, what="sendbuf")
            _same(call, s, "sendbuf", r, "each block of recvbuf")
            x = s.bytes()
        try:
            c.allgather(x, out=out)
        except MismatchError as exc:
            raise _in_elements(exc, call, "recvbuf", r, r.count * c.size) from exc.__cause__

    def Scatter(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Block r of root's ``sendbuf`` into rank r's ``recvbuf``."""
        call = "Scatter"
        c = self._c
        if c.rank == root:
            s = message(sendbuf, call, blocks=c.size, what="sendbuf")
            x = s.bytes(s.displs[0], s.count * c.size)
            if _in_place(recvbuf):
                out = np.empty(s.count * s.extent, np.uint8)
            else:
                m = message(recvbuf, call, what="recvbuf")
                _same(call, s, "each block of root's sendbuf", m, "recvbuf")
                out = m.bytes()
            try:
                c.scatter(x, root, out=out)
            except MismatchError as exc:
                raise _in_elements(exc, call, "sendbuf", s, s.count * c.size) from exc.__cause__
        else:
            m = message(recvbuf, call, what="recvbuf")
            try:
                c.scatter(None, root, out=m.bytes())
            except MismatchError as exc:
                raise _in_elements(exc, call, "recvbuf", m, m.count) from exc.__cause__

    def Alltoall(self, sendbuf: Any, recvbuf: Any) -> None:
        """Block j of every rank's ``sendbuf`` to rank j; blocks land in rank order."""
        call = "Alltoall"
        c = self._c
        r = message(recvbuf, call, blocks=c.size, what="recvbuf")
        out = r.bytes(r.displs[0], r.count * c.size)
        if _in_place(sendbuf):
            x = out.copy()
        else:
            s = message(sendbuf, call, blocks=c.size, what="sendbuf")
            _same(call, s, "each block of sendbuf", r, "each block of recvbuf")
            x = s.bytes(s.displs[0], s.count * c.size)
        try:
            c.alltoall(x, out=out)
        except MismatchError as exc:
            raise _in_elements(exc, call, "recvbuf", r, r.count * c.size) from exc.__cause__

    def Reduce_scatter_block(self, sendbuf: Any, recvbuf: Any, op: Any = _SUM) -> None:
        """Reduce every rank's ``sendbuf``, then block r of the result to rank r."""
        call = "Reduce_scatter_block"
        c = self._c
        if _in_place(sendbuf):
            r = message(recvbuf, call, blocks=c.size, what="recvbuf")
            x = r.typed(r.displs[0], r.count * c.size).copy()
        else:
            # The send count is per block, as mpi4py reads it (and Scatter's, Alltoall's):
            # [sb, 2, MPI.DOUBLE] is 2 elements for each of the size ranks.
            r = message(recvbuf, call, what="recvbuf")
            s = message(sendbuf, call, blocks=c.size, what="sendbuf")
            _one_datatype(call, s, r)
            _same(call, s, "each block of sendbuf", r, "recvbuf")
            x = s.typed(s.displs[0], s.count * c.size)
        out = r.typed(r.displs[0], r.count)
        op = _mpi_op(op, r.datatype, call)
        if op.loc is not None:
            whole = np.empty_like(x)
            self._allreduce_into(x, whole, op, call)
            out[...] = whole[c.rank * r.count : (c.rank + 1) * r.count]
        else:
            c.reduce_scatter(x, _plait_op(op), out=out)

    def Reduce_scatter(
        self, sendbuf: Any, recvbuf: Any, recvcounts: Any = None, op: Any = _SUM
    ) -> None:
        """Reduce every rank's ``sendbuf``, then ``recvcounts[r]`` elements to rank r.

        Without ``recvcounts`` every rank's count is its ``recvbuf``'s, learned with one
        allgather.
        """
        call = "Reduce_scatter"
        c = self._c
        r = message(recvbuf, call, what="recvbuf")
        s = None if _in_place(sendbuf) else message(sendbuf, call, what="sendbuf")
        if s is not None:
            _one_datatype(call, s, r)
        op = _mpi_op(op, r.datatype, call)
        if recvcounts is None:
            mine = np.array([r.count], np.int64)
            counts = [int(v) for v in c.allgather(mine).reshape(-1)]
        else:
            counts = ints(recvcounts, "recvcounts", call)
        total = sum(counts)
        if s is None:
            if r.count < total:
                raise ValueError(
                    f"{call}: recvbuf holds {r.count} element(s) of {r.datatype.name}, but "
                    f"recvcounts {counts} add up to {total}; with MPI.IN_PLACE recvbuf holds "
                    "the whole send data"
                )
            x = r.typed(r.displs[0], total).copy()
        else:
            if s.count != total:
                raise ValueError(
                    f"{call}: sendbuf holds {s.count} element(s) of {s.datatype.name}, but "
                    f"recvcounts {counts} add up to {total}; they must be equal"
                )
            if r.count < counts[c.rank]:
                raise ValueError(
                    f"{call}: message truncated (MPI_ERR_TRUNCATE): recvbuf holds {r.count} "
                    f"element(s) of {r.datatype.name}, but recvcounts[{c.rank}] is "
                    f"{counts[c.rank]}"
                )
            x = s.typed(s.displs[0], total)
        out = r.typed(r.displs[0], counts[c.rank])
        if op.loc is not None:
            whole = np.empty_like(x)
            self._allreduce_into(x, whole, op, call)
            start = sum(counts[: c.rank])
            out[...] = whole[start : start + counts[c.rank]]
        else:
            c.reduce_scatter(x, _plait_op(op), counts=counts, out=out)

    def Gatherv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """Every rank's ``sendbuf`` into root's ``recvbuf`` at ``displs``, ``counts`` each.

        The counts are significant at root only (as in MPI), so the ranks first learn each
        other's sizes: one allgather of one int64 per rank. Root raises ValueError where a
        rank's size is not its count (the others return, as MPI's do).
        """
        call = "Gatherv"
        c = self._c
        r = vector(recvbuf, c.size, call, "recvbuf") if c.rank == root else None
        if sendbuf is IN_PLACE or (sendbuf is None and r is not None):
            if r is None:
                raise ValueError(f"{call}: MPI.IN_PLACE is for root's send buffer only")
            x = r.bytes(r.displs[root], r.counts[root]).copy()
        else:
            x = message(sendbuf, call, what="sendbuf").bytes()
        sent = c.allgather(np.array([x.size], np.int64)).reshape(-1).tolist()  # bytes
        if r is None:
            c.gatherv(x, sent, root)
            return
        # Root checks each rank's size, not only the sum (a rank's surplus went into the
        # next rank's block); the data is gathered first, so no rank waits on it.
        fits = sent == r.block_bytes()
        out = r.raw[: sum(sent)] if r.packed() and fits else None
        got = c.gatherv(x, sent, root, out=out)
        assert got is not None  # root gets the result
        if not fits:
            bad = [i for i, (n, b) in enumerate(zip(sent, r.block_bytes(), strict=True)) if n != b]
            raise ValueError(
                f"{call}: root expects {r.counts} elements of {r.datatype.name} from the ranks, "
                f"but rank(s) {bad} sent "
                + ", ".join(f"{sent[i] / r.extent:g}" for i in bad)
                + " (MPI_ERR_TRUNCATE where a rank sent more)"
            )
        if out is None:
            _unpack(r, got)

    def Allgatherv(self, sendbuf: Any, recvbuf: Any) -> None:
        """Every rank's ``sendbuf`` into every rank's ``recvbuf`` at ``displs``."""
        call = "Allgatherv"
        c = self._c
        r = vector(recvbuf, c.size, call, "recvbuf")
        if _in_place(sendbuf):
            x = r.bytes(r.displs[c.rank], r.counts[c.rank]).copy()
        else:
            s = message(sendbuf, call, what="sendbuf")
            _own_block(s, r, c.rank, call, f"recvbuf's count for this rank (counts[{c.rank}])")
            x = s.bytes()
        out = r.raw[: sum(r.counts) * r.extent] if r.packed() else None
        got = c.allgatherv(x, r.block_bytes(), out=out)
        if out is None:
            _unpack(r, got)

    def Scatterv(self, sendbuf: Any, recvbuf: Any, root: int = 0) -> None:
        """``counts[r]`` elements of root's ``sendbuf`` at ``displs[r]`` to rank r.

        Off root, ``recvbuf`` must hold exactly what root sends this rank; where it does
        not, the rank still takes part (the others get their data), ``recvbuf`` is not
        written and ValueError says both sizes in elements of its datatype. Root's own
        ``recvbuf`` may be longer than its block, as MPI's: its start is filled (Note [root's
        own block]).

        Note [root's own block]
            Root knows its own count before the call, and used to refuse a ``recvbuf`` of
            another size then, before it joined the call: the other ranks, already in it,
            waited for root until their deadline, and the communicator was broken for
            them. MPI takes a longer buffer and fills its start, so root does that; a
            shorter one is MPI's truncation error, which root raises once the call is
            done, as a rank off root does: the others get their data, and root's
            ``recvbuf`` is not written.
        """
        call = "Scatterv"
        c = self._c
        if c.rank != root:
            m = message(recvbuf, call, what="recvbuf")
            try:
                c.scatterv(None, None, root, out=m.bytes())
            except ValueError as exc:
                said = _scattered(exc, call, m)
                if said is exc:
                    raise
                raise said from None
            return
        s = vector(sendbuf, c.size, call, "sendbuf")
        x = _pack(s)
        mine = s.counts[root] * s.extent
        short = None
        if _in_place(recvbuf):
            out = np.empty(mine, np.uint8)
        else:  # Note [root's own block]
            m = message(recvbuf, call, what="recvbuf")
            if m.count * m.extent >= mine:
                out = m.bytes()[:mine]
            else:
                short, out = m, np.empty(mine, np.uint8)
        c.scatterv(x, s.block_bytes(), root, out=out)
        if short is not None:
            n, name = s.counts[root], s.datatype.name
            raise mpi_error(
                "ERR_TRUNCATE",
                f"{call}: message truncated (MPI_ERR_TRUNCATE): root sends itself {n} {name} "
                f"({mine} bytes), but recvbuf holds {short.count} {short.datatype.name} "
                f"({short.count * short.extent} bytes); recvbuf was not written, and the "
                "other ranks have their data",
            )

    def Alltoallv(self, sendbuf: Any, recvbuf: Any) -> None:
        """``sendcounts[j]`` elements from ``sdispls[j]`` to rank j; arrivals at ``rdispls``."""
        call = "Alltoallv"
        c = self._c
        r = vector(recvbuf, c.size, call, "recvbuf")
        if _in_place(sendbuf):
            s = r
            x = _pack(r).copy()
        else:
            s = vector(sendbuf, c.size, call, "sendbuf")
            x = _pack(s)
            if s.counts[c.rank] * s.extent != r.counts[c.rank] * r.extent:
                raise ValueError(
                    f"{call}: this rank sends itself {s.counts[c.rank]} element(s) of "
                    f"{s.datatype.name} but receives {r.counts[c.rank]} of {r.datatype.name} "
                    f"from itself (sendcounts[{c.rank}] and recvcounts[{c.rank}] must hold the "
                    "same bytes)"
                )
        out = r.raw[: sum(r.counts) * r.extent] if r.packed() else None
        try:
            got = c.alltoallv(x, s.block_bytes(), r.block_bytes(), out=out)
        except ValueError as exc:
            said = _disagreeing(exc, call, s, r)
            if said is exc:
                raise
            raise said from None
        if out is None:
            _unpack(r, got)
