"""The object collectives on the communicator, against pickle and plain Python.

Threads play the ranks. Nested objects carry numpy arrays above and below
the out-of-band and separate-message sizes; a rank whose object fails to
pickle makes every rank raise, naming it, and leaves the communicator
usable; ``allreduce_object`` folds a non-commutative op in rank order.
"""

from __future__ import annotations

import functools
import operator
import pickle
import threading
from typing import Any

import numpy as np
import pytest

import plait
from plait._object_methods import Lanes
from plait.errors import CommTimeout
from plait.testing import run_ranks

QUICK = [1, 2, 3, 5]
SIZES = [*QUICK, *(pytest.param(p, marks=pytest.mark.slow) for p in (4, 7, 8))]


def _obj(q: int, tag: str = "") -> dict[str, Any]:
    """A nested object of rank ``q``: small and large arrays, strings, tuples, None."""
    return {
        "rank": q,
        "tag": tag,
        "small": np.arange(q + 1, dtype=np.int16),
        "big": np.full((300 * (q + 1), 3), q, np.float32),  # out of band (>= 1 KiB)
        "strided": np.arange(4000.0)[:: q + 2],  # not contiguous: copied once on the sender
        "nested": [("x" * q, {"y": None, "z": np.ones(q, np.uint8)})],
    }


def _same(got: Any, want: Any) -> None:
    """Equal, arrays compared by dtype, shape and value."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert np.array_equal(got, want)
    elif isinstance(want, dict):
        assert isinstance(got, dict)
        assert got.keys() == want.keys()
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert type(got) is type(want)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _same(g, w)
    else:
        assert got == want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", SIZES)
def test_object_collectives_match_pickle(size: int) -> None:
    def body(comm: plait.Communicator) -> None:
        r = comm.rank
        mine = _obj(r)
        for root in sorted({0, size - 1}):
            _same(comm.bcast_object(mine if r == root else None, root), _obj(root))
            got = comm.gather_object(mine, root)
            if r == root:
                _same(got, [_obj(q) for q in range(size)])
            else:
                assert got is None
            objs = [_obj(q, f"from {root}") for q in range(size)] if r == root else None
            _same(comm.scatter_object(objs, root), _obj(r, f"from {root}"))
        _same(comm.allgather_object(mine), [_obj(q) for q in range(size)])
        sent = [_obj(j, f"{r}->{j}") for j in range(size)]
        _same(comm.alltoall_object(sent), [_obj(r, f"{q}->{r}") for q in range(size)])
        assert comm.allgather_object(None) == [None] * size
        word = comm.allreduce_object(chr(ord("a") + r), operator.add)
        assert word == "".join(chr(ord("a") + q) for q in range(size))  # rank order
        assert comm.allreduce_object([r], operator.add) == list(range(size))

    run_ranks(size, body, timeout=120)


def test_large_buffers_travel_as_messages_of_their_own() -> None:
    """bcast and send move buffers of 1 MiB and more uncopied; the arrays arrive writable."""

    def body(comm: plait.Communicator) -> None:
        big = np.arange(1 << 18, dtype=np.float64)  # 2 MiB
        got = comm.bcast_object({"w": big, "b": b"bytes"} if comm.rank == 0 else None)
        assert np.array_equal(got["w"], big)
        assert got["b"] == b"bytes"
        if comm.rank == 0:
            comm.send_object([big, "tail"], 1, tag=7)
        else:
            arr, tail = comm.recv_object(0, tag=7)
            assert np.array_equal(arr, big)
            assert tail == "tail"
            assert arr.flags.writeable

    run_ranks(2, body)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_a_rank_that_cannot_pickle_makes_every_rank_raise(size: int) -> None:
    bad = size - 1

    def body(comm: plait.Communicator) -> None:
        r = comm.rank
        obj = threading.Lock() if r == bad else r
        calls = [
            lambda: comm.allgather_object(obj),
            lambda: comm.gather_object(obj, 0),
            lambda: comm.allreduce_object(obj, operator.add),
            lambda: comm.bcast_object(obj, bad),
            lambda: comm.alltoall_object([obj] * size),
            lambda: comm.scatter_object([obj] * size if r == bad else None, bad),
        ]
        for call in calls:
            with pytest.raises(pickle.PicklingError, match=rf"\b{bad}\b.*could not be pickled"):
                call()
        # every rank made the same collectives: the communicator is still usable
        assert comm.allgather_object(r) == list(range(size))

    run_ranks(size, body)


def test_send_object_that_cannot_pickle_raises_on_both_ends() -> None:
    def body(comm: plait.Communicator) -> None:
        call = (
            (lambda: comm.send_object(lambda: 1, 1))
            if comm.rank == 0
            else (lambda: comm.recv_object(0))
        )
        with pytest.raises(pickle.PicklingError, match="rank 0"):
            call()
        if comm.rank == 0:
            comm.send_object("ok", 1)
        else:
            assert comm.recv_object(0) == "ok"

    run_ranks(2, body)


def test_a_timeout_names_the_object_call_and_its_whole_timeout() -> None:
    """A receive's timeout named a plain ``recv`` and what its message had left of the
    object's deadline (``within 0.99997 s``)."""

    def body(comm: plait.Communicator) -> None:
        if comm.rank == 1:
            with pytest.raises(CommTimeout) as got:
                comm.recv_object(0, tag=9, timeout=0.5)
            assert str(got.value).startswith(
                "rank 1: recv_object from rank 0 (tag 9) did not complete within 0.5 s; the "
                "peer may have died"
            ), got.value
        comm.barrier()

    run_ranks(2, body)


def test_a_rank_sends_an_object_to_itself() -> None:
    """``send`` to this rank worked, and mpi4py's ``comm.send(obj, dest=comm.rank)`` does;
    ``send_object`` refused its own rank."""

    def body(comm: plait.Communicator) -> Any:
        big = np.arange(300_000.0)  # a buffer of its own among the messages
        comm.send_object({"rank": comm.rank, "big": big}, comm.rank, tag=4)
        got = comm.recv_object(comm.rank, tag=4)
        return got["rank"], bool(np.array_equal(got["big"], big))

    assert run_ranks(2, body) == [(0, True), (1, True)]


def _refuse() -> None:
    raise ValueError("boom on unpickle")


class _Unloadable:
    """Pickles, but its unpickling raises (a ``__setstate__`` that checks, say)."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


def test_an_object_that_fails_to_unpickle_is_named() -> None:
    """Unpickling that raised gave the object's bare error, naming no call and no rank; it
    keeps its class, with a note of the call and the rank whose object it was."""

    def body(comm: plait.Communicator) -> list[str]:
        notes = []
        for call in (
            lambda: comm.bcast_object(_Unloadable() if comm.rank == 1 else None, root=1),
            lambda: comm.allgather_object(_Unloadable() if comm.rank == 1 else 0),
            lambda: comm.scatter_object([0, _Unloadable()] if comm.rank == 0 else None),
        ):
            try:
                call()
            except ValueError as exc:
                notes.append(f"{exc}: " + " ".join(getattr(exc, "__notes__", [])))
        return notes

    got = run_ranks(2, body)
    boom = "boom on unpickle: "
    assert got[0] == [
        boom + "rank 0: bcast_object: the object of rank 1 could not be unpickled here",
        boom + "rank 0: allgather_object: the object of rank 1 could not be unpickled here",
    ], got[0]
    assert got[1] == [
        boom + "rank 1: allgather_object: the object of rank 1 could not be unpickled here",
        boom + "rank 1: scatter_object: the object root (rank 0) gave this rank could not be "
        "unpickled here",
    ], got[1]


def test_wrong_arguments_raise() -> None:
    def body(comm: plait.Communicator) -> None:
        with pytest.raises(ValueError, match="root 2 is out of range"):
            comm.bcast_object(1, 2)
        with pytest.raises(TypeError, match="op must be callable"):
            comm.allreduce_object(1, "add")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"dst=2 is invalid; expected a rank in 0..1"):
            comm.send_object(1, 2)
        # a wrong list length on one rank: it raises ValueError saying what it got, and the
        # others a ValueError naming it (they used to be told of a pickling failure)
        objs = [1] if comm.rank == 0 else [1, 2]
        message = "got a list of 1" if comm.rank == 0 else r"rank 0 did not pass a sequence of 2"
        with pytest.raises(ValueError, match=message):
            comm.alltoall_object(objs)
        assert comm.alltoall_object([comm.rank] * 2) == [0, 1]

    run_ranks(2, body)


def test_a_root_that_passes_the_wrong_number_of_objects_is_named_on_every_rank() -> None:
    def body(comm: plait.Communicator) -> None:
        if comm.rank == 0:
            with pytest.raises(ValueError, match=r"sequence of 3 objects.*got a list of 2"):
                comm.scatter_object(["a", "b"], 0)
        else:
            with pytest.raises(ValueError, match=r"root \(rank 0\) did not pass a sequence of 3"):
                comm.scatter_object(None, 0)
        assert comm.scatter_object(["a", "b", "c"] if comm.rank == 0 else None) == "abc"[comm.rank]

    run_ranks(3, body)


def test_an_array_of_one_object_per_rank_is_scattered_by_its_rows() -> None:
    """As mpi4py's scatter and alltoall, which index what they are given: a numpy array of
    ``size`` rows serves (it was refused as "not a sequence of 2 ... got a ndarray of 2")."""

    def body(comm: plait.Communicator) -> None:
        grid = np.arange(6.0).reshape(2, 3) + 10 * comm.rank
        got = comm.scatter_object(grid if comm.rank == 0 else None, 0)
        np.testing.assert_array_equal(got, np.arange(3.0) + 3 * comm.rank)
        parts = comm.alltoall_object(grid)
        for q in range(2):
            np.testing.assert_array_equal(parts[q], np.arange(3.0) + 3 * comm.rank + 10 * q)
        with pytest.raises(ValueError, match=r"sequence of 2 objects, one per rank; got a set of"):
            comm.alltoall_object({1, 2})

    run_ranks(2, body)


def test_an_op_that_raises_does_so_on_every_rank() -> None:
    def body(comm: plait.Communicator) -> None:
        obj: Any = 1 if comm.rank == 0 else "s"
        with pytest.raises(TypeError) as info:
            comm.allreduce_object(obj, operator.add)
        assert "rank 1's object" in "".join(info.value.__notes__)

    run_ranks(2, body)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "part"),
    [
        ("allgather_object", "allgatherv"),
        ("gather_object", "gatherv"),
        ("allreduce_object", "allgatherv"),
    ],
)
def test_a_failure_in_the_second_part_names_the_object_call(name: str, part: str) -> None:
    # Rank 1 takes part in the exchange of lengths only, then leaves: rank 0's call fails in
    # the exchange of the messages, which used to name a bare ``allgatherv``/``gatherv`` and
    # say that an output buffer the caller never gave was left undefined.
    from plait.collectives import get

    def body(comm: plait.Communicator) -> str | None:
        if comm.rank == 1:
            word = np.array([64], np.uint64)
            comm._within(get("allgather"), word, name, 5)  # type: ignore[attr-defined]
            return None
        if name == "allreduce_object":
            call = functools.partial(comm.allreduce_object, "x", operator.add, timeout=5)
        else:
            call = functools.partial(getattr(comm, name), "x", timeout=5)
        with pytest.raises(plait.PeerLostError) as info:
            call()
        return str(info.value)

    message = run_ranks(2, body)[0]
    assert message is not None
    assert f"rank 0: {name}'s {part} (" in message, message
    assert "buffer" not in message, message


def test_a_mismatch_names_the_peers_long_call_whole() -> None:
    """Different roots of gather_object: the peer's call was named in 40 bytes, "...'s
    gatherv (binomial, call " without its number."""
    from plait.runtime.crossing import NAME_BYTES, wire_name

    def body(comm: plait.Communicator) -> str:
        with pytest.raises(plait.MismatchError) as info:
            comm.gather_object(comm.rank, root=comm.rank, timeout=10)
        return str(info.value)

    for r, said in enumerate(run_ranks(2, body)):
        assert f"rank {1 - r} is in a different call, gather_object's gatherv (" in said
        assert ", call #1), and waits like this rank" in said
    long = "é" * 60 + " (ring, call #123456)"
    cut = wire_name(long)
    assert len(cut) <= NAME_BYTES
    text = cut.decode("utf-8")  # strict: no character cut in two
    assert text.startswith("é" * 10)
    assert "..." in text
    assert text.endswith(" (ring, call #123456)")


def test_a_lane_taken_past_the_timeout_raises_and_leaves_nothing_behind() -> None:
    # Note [one object at a time on a lane]: a thread that finds the peer and tag taken
    # by another's object for its whole timeout raises, sending nothing.
    lanes = Lanes()
    taken = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with lanes.hold(("send", 1, 4), 5.0, "rank 0: send_object to 1"):
            taken.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert taken.wait(10)
    try:
        same = lanes.hold(("send", 1, 4), 0.05, "rank 0: send_object to 1")
        taken_by_another = r"another thread.s send_object on the same peer"
        with pytest.raises(CommTimeout, match=taken_by_another), same:
            pass
        with lanes.hold(("send", 1, 5), 0.05, "rank 0: send_object to 1"):  # another tag
            pass
        with lanes.hold(("recv", 1, 4), 0.05, "rank 0: recv_object from 1"):  # receiving
            pass
    finally:
        release.set()
        t.join(10)
    assert lanes._lanes == {}  # a lane lives while some thread holds or waits for it


def test_object_calls_given_a_wildcard_say_what_to_do_instead() -> None:
    # recv_object(plait.ANY_SOURCE), as mpi4py's recv defaults to, said only "src=-1 is
    # invalid; expected a rank in 0..1".
    comm = plait.init()  # one rank
    with pytest.raises(ValueError, match=r"recv_object takes no ANY_SOURCE: probe\(plait"):
        comm.recv_object(plait.ANY_SOURCE)
    with pytest.raises(ValueError, match=r"dst=-1 is invalid; .*ANY_SOURCE is for receives and"):
        comm.send_object("x", plait.ANY_SOURCE)
    with pytest.raises(ValueError, match="send_object takes no PROC_NULL: skip the call"):
        comm.send_object("x", plait.PROC_NULL)
    with pytest.raises(ValueError, match=r"src=5 is invalid; expected a rank in 0..0$"):
        comm.recv_object(5)
    comm.close()
