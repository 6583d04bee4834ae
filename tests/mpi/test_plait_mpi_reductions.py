"""plait.mpi's reductions refuse what mpi4py on Open MPI refuses, as it does: send and
receive buffers of two datatypes (ValueError, "mismatch in send and receive MPI datatypes")
and an op the datatype does not take (MPI.Exception of class ERR_OP). Every expected value
here is what mpi4py 4.1 on Open MPI 4.1 gave for the same call."""

from __future__ import annotations

import array
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pytest

from plait import mpi as MPI
from plait.mpi._datatypes import message
from plait.testing import run_ranks

MISMATCH = "mismatch in send and receive MPI datatypes"
ERR_OP_WORDS = "MPI_ERR_OP: invalid reduce operation"


def ranks(size: int, fn: Callable[[MPI.Comm], Any]) -> list[Any]:
    """``fn`` on ``size`` threads, each with an mpi4py communicator over plait's."""
    return run_ranks(size, lambda c: fn(MPI.Comm(c, "test")), timeout=30)


def said(call: Callable[[], Any]) -> str:
    """What ``call`` raised, as the class and the message (or "ok")."""
    try:
        call()
    except MPI.Exception as e:
        return f"ERR {e.Get_error_class()}: {e}"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


# -- send and receive datatypes ------------------------------------------------------------
def test_a_buffer_alone_has_the_datatype_mpi4py_reads_from_its_format() -> None:
    """An int8 array was INT8_T (mpi4py: SIGNED_CHAR), "q" LONG (LONG_LONG), a uint8 array
    and a bytearray BYTE (UNSIGNED_CHAR), the typecode "i4" INT (INT32_T)."""
    got = {
        "b": message(np.zeros(1, "b"), "t").datatype,
        "q": message(np.zeros(1, "q"), "t").datatype,
        "l": message(np.zeros(1, "l"), "t").datatype,
        "B": message(np.zeros(1, "B"), "t").datatype,
        "bytearray": message(bytearray(1), "t").datatype,
        "array B": message(array.array("B", [0]), "t").datatype,
        "'i4'": message([np.zeros(1, "i"), "i4"], "t").datatype,
        "'i'": message([np.zeros(1, "i"), "i"], "t").datatype,
        "'b'": message([np.zeros(1, "b"), "b"], "t").datatype,
    }
    assert got == {
        "b": MPI.SIGNED_CHAR,
        "q": MPI.LONG_LONG,
        "l": MPI.LONG,
        "B": MPI.UNSIGNED_CHAR,
        "bytearray": MPI.UNSIGNED_CHAR,
        "array B": MPI.UNSIGNED_CHAR,
        "'i4'": MPI.INT32_T,
        "'i'": MPI.INT,
        "'b'": MPI.SIGNED_CHAR,
    }


#: (send, receive) buffers, and whether mpi4py reduces them (True) or refuses them.
PAIRS: list[tuple[str, Callable[[], Any], Callable[[], Any], bool]] = [
    ("DOUBLE, LONG", lambda: [np.ones(2), MPI.DOUBLE], lambda: [np.zeros(2, "l"), MPI.LONG], False),
    ("1 DOUBLE, 2 INT", lambda: [np.ones(1), MPI.DOUBLE], lambda: [np.zeros(2, "i"), MPI.INT],
     False),
    ("INT, INT32_T", lambda: [np.ones(1, "i"), MPI.INT], lambda: [np.zeros(1, "i"), MPI.INT32_T],
     False),
    ("l and q arrays", lambda: np.ones(2, "l"), lambda: np.zeros(2, "q"), False),
    ("uint8 array, BYTE", lambda: np.ones(2, "B"), lambda: [np.zeros(2, "B"), MPI.BYTE], False),
    ("'i4', int32 array", lambda: [np.ones(2, "i"), "i4"], lambda: np.zeros(2, "i"), False),
    ("0 DOUBLE, 0 LONG", lambda: [np.ones(2), 0, MPI.DOUBLE],
     lambda: [np.zeros(2, "l"), 0, MPI.LONG], False),
    ("int8 array, SIGNED_CHAR", lambda: np.ones(2, "b"),
     lambda: [np.zeros(2, "b"), MPI.SIGNED_CHAR], True),
    ("uint8 array, UNSIGNED_CHAR", lambda: np.ones(2, "B"),
     lambda: [np.zeros(2, "B"), MPI.UNSIGNED_CHAR], True),
    ("'i4', INT32_T", lambda: [np.ones(2, "i"), "i4"], lambda: [np.zeros(2, "i"), MPI.INT32_T],
     True),
    ("BOOL, C_BOOL", lambda: [np.ones(2, "?"), MPI.BOOL], lambda: [np.zeros(2, "?"), MPI.C_BOOL],
     True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sent", "kept", "same"), [p[1:] for p in PAIRS], ids=[p[0] for p in PAIRS]
)
def test_reductions_refuse_two_datatypes_as_mpi4py_does(
    sent: Callable[[], Any], kept: Callable[[], Any], same: bool
) -> None:
    """Two datatypes raised plait's TypeError naming ``out`` and numpy dtypes (or passed,
    where the numpy dtype was one); mpi4py raises ValueError, in every reduction, before
    anything moves."""

    def body(c: MPI.Comm) -> list[str]:
        n = c.Get_size()
        op = MPI.LAND if message(kept(), "t").datatype is MPI.C_BOOL else MPI.SUM

        def blocks(spec: Any) -> Any:  # n blocks of the send spec, for Reduce_scatter*
            if isinstance(spec, list):
                return [np.concatenate([spec[0]] * n), *spec[1:]]
            return np.concatenate([spec] * n)

        out = [
            said(lambda: c.Allreduce(sent(), kept(), op)),
            said(lambda: c.Reduce_scatter_block(blocks(sent()), kept(), op)),
            said(lambda: c.Reduce_scatter(blocks(sent()), kept(), None, op)),
        ]
        c.Barrier()  # nothing moved where they were refused: the ranks are still in step
        total = np.zeros(1, "i")
        c.Allreduce(np.ones(1, "i"), total)
        return [*out, str(total[0])]

    want = "ok" if same else f"ValueError: {MISMATCH}"
    assert ranks(2, body) == [[want, want, want, "2"]] * 2


def test_a_reduce_root_refuses_two_datatypes_and_the_others_complete() -> None:
    """mpi4py checks Reduce's buffers at root: root raises ValueError, the other ranks'
    Reduce returns, and the next calls go on. plait.mpi's root raised before the call and
    the others, in it, failed with MismatchError at the next one."""

    def body(c: MPI.Comm) -> list[Any]:
        root = c.Get_rank() == 0
        got = []
        for kept in ([np.full(1, -1, "i"), MPI.INT32_T], [np.full(2, -1, "i"), MPI.INT]):
            sent = [np.ones(1, "i"), MPI.INT]
            got.append(said(partial(c.Reduce, sent, kept if root else None, MPI.SUM, 0)))
            got.append(kept[0].tolist())  # root's recvbuf is not written
        total = np.zeros(1, "i")
        c.Allreduce(np.ones(1, "i"), total)
        return [*got, int(total[0])]

    root, other = ranks(2, body)
    assert root[0] == f"ValueError: {MISMATCH}"
    assert root[2].startswith("ValueError: Reduce: sendbuf is 1 INT (4 bytes) but root's")
    assert [root[1], root[3], root[4]] == [[-1], [-1, -1], 2]
    assert other == ["ok", [-1], "ok", [-1, -1], 2]


# -- ops and datatypes ---------------------------------------------------------------------
_INTEGER_LIKE = "SUM PROD MAX MIN LAND LOR LXOR BAND BOR BXOR"
#: The ops Allreduce takes on each datatype under mpi4py on Open MPI (all others raise
#: MPI.Exception of class ERR_OP, for a count of 0 too).
TAKES = {
    **dict.fromkeys(
        [
            *("BYTE", "CHAR", "SIGNED_CHAR", "UNSIGNED_CHAR", "SHORT", "UNSIGNED_SHORT", "INT"),
            *("UNSIGNED", "LONG", "UNSIGNED_LONG", "LONG_LONG", "UNSIGNED_LONG_LONG", "INT8_T"),
            *("INT16_T", "INT32_T", "INT64_T", "UINT8_T", "UINT16_T", "UINT32_T", "UINT64_T"),
            *("AINT", "OFFSET", "COUNT"),
        ],
        _INTEGER_LIKE,
    ),
    **dict.fromkeys(
        ["FLOAT", "DOUBLE", "LONG_DOUBLE", "REAL", "DOUBLE_PRECISION"], "SUM PROD MAX MIN"
    ),
    "C_BOOL": "LAND LOR LXOR",
    **dict.fromkeys(
        ["C_COMPLEX", "C_DOUBLE_COMPLEX", "C_LONG_DOUBLE_COMPLEX", "COMPLEX", "DOUBLE_COMPLEX"],
        "SUM PROD",
    ),
    "INTEGER": "SUM PROD MAX MIN BAND BOR BXOR",
    **dict.fromkeys(
        ["FLOAT_INT", "DOUBLE_INT", "LONG_INT", "TWOINT", "SHORT_INT", "LONG_DOUBLE_INT"],
        "MAXLOC MINLOC",
    ),
}  # fmt: skip
OPS = [*_INTEGER_LIKE.split(), "MAXLOC", "MINLOC"]
#: plait.mpi's own reading, which mpi4py refuses (ERR_OP): MAXLOC and MINLOC of a plain
#: array of integers or floats take it as (value, index) rows.
ROWS = [k for k, v in TAKES.items() if v == _INTEGER_LIKE or k in ("FLOAT", "DOUBLE", "REAL")]
ROWS += ["LONG_DOUBLE", "DOUBLE_PRECISION", "INTEGER"]


def test_an_op_the_datatype_does_not_take_raises_mpi_err_op() -> None:
    """BOR and MAX of doubles and complex raised a plain TypeError (not MPI.Exception), and
    LAND of doubles and SUM of bools were computed; Open MPI refuses each with ERR_OP."""

    def body(c: MPI.Comm) -> dict[str, str]:
        took: dict[str, list[str]] = {}
        for name in TAKES:
            dt = getattr(MPI, name)
            for count in (2, 0):
                for op in OPS:
                    x, y = bytearray(2 * dt.extent), bytearray(2 * dt.extent)
                    sent, kept = [x, count, dt], [y, count, dt]
                    got = said(partial(c.Allreduce, sent, kept, getattr(MPI, op)))
                    if got == "ok":
                        took.setdefault(f"{name}/{count}", []).append(op)
                    else:
                        assert got == f"ERR 10: {ERR_OP_WORDS}", (name, op, got)
        return {k: " ".join(v) for k, v in took.items()}

    want = {k: v + " MAXLOC MINLOC" if k in ROWS else v for k, v in TAKES.items()}
    for got in ranks(2, body):
        assert got == {f"{k}/{n}": v for k, v in want.items() for n in (2, 0)}


def test_every_reduction_refuses_an_op_before_anything_moves() -> None:
    """MPI.Exception of class ERR_OP (also a ValueError), on every rank, in each reduction
    and with IN_PLACE, and the communicator stays usable."""

    def body(c: MPI.Comm) -> list[str]:
        n, root = c.Get_size(), c.Get_rank() == 0
        calls = [
            lambda: c.Allreduce(np.ones(2), np.zeros(2), MPI.BOR),
            lambda: c.Allreduce(MPI.IN_PLACE, np.ones(2, "?"), MPI.SUM),
            lambda: c.Reduce(np.ones(2), np.zeros(2) if root else None, MPI.LAND, 0),
            lambda: c.Reduce(
                MPI.IN_PLACE if root else np.ones(1, "D"), np.ones(1, "D"), MPI.MAX, 0
            ),
            lambda: c.Reduce_scatter_block(np.ones(n), np.zeros(1), MPI.BXOR),
            lambda: c.Reduce_scatter(np.ones(n), np.zeros(1), [1] * n, MPI.BOR),
            lambda: c.Reduce_scatter(MPI.IN_PLACE, np.zeros(n), None, MPI.BOR),
            lambda: c.Allreduce(np.ones(2, "?"), np.zeros(2, "?"), MPI.MAXLOC),
        ]
        out = []
        for call in calls:
            with pytest.raises(ValueError, match=ERR_OP_WORDS) as info:
                call()
            e = info.value
            assert isinstance(e, MPI.Exception)
            out.append(f"{e.Get_error_class()}: {e}")
        total = np.zeros(1, "i")
        c.Allreduce(np.ones(1, "i"), total)
        rows = np.array([[1.0, 0.0], [5.0, 1.0]]) * (c.Get_rank() + 1)  # plait's own reading
        best = np.zeros_like(rows)
        c.Allreduce(rows, best, MPI.MAXLOC)
        return [*out, str(total[0]), str(best.tolist())]

    want = [f"10: {ERR_OP_WORDS}"] * 8 + ["2", "[[2.0, 0.0], [10.0, 2.0]]"]
    assert ranks(2, body) == [want, want]


def test_an_mpi_err_op_says_the_call_op_and_datatype_in_a_note() -> None:
    """Its message is MPI's words, as mpi4py's; a note says what was refused."""

    def body(c: MPI.Comm) -> list[str]:
        try:
            c.Allreduce(np.ones(2), np.zeros(2), MPI.BOR)
        except MPI.Exception as exc:
            return [str(exc), *getattr(exc, "__notes__", [])]
        return []

    for got in ranks(2, body):
        assert got[0] == ERR_OP_WORDS
        assert got[1].startswith("Allreduce: MPI.BOR is not defined on DOUBLE")


@pytest.mark.parametrize(
    "spec",
    [lambda: [np.ones(2)], lambda: [], lambda: [np.ones(2), 2, 0, MPI.DOUBLE, 1]],
    ids=["one item", "no item", "five items"],
)
def test_a_specification_of_other_than_2_to_4_items_is_refused(spec: Callable[[], Any]) -> None:
    """``[a]`` was read as ``a`` alone; mpi4py: ValueError "expecting 2 to 4 items"."""

    def body(c: MPI.Comm) -> list[str]:
        return [
            said(lambda: c.Allreduce(spec(), np.zeros(2))),
            said(lambda: c.Allreduce(np.ones(2), spec())),
            said(lambda: c.Send(spec(), 0)),
        ]

    for got in ranks(1, body):
        for one in got:
            assert one.startswith("ValueError: "), one
            assert "expecting 2 to 4 items" in one, one
