"""The Communicator's contract: out=, in place, strided arrays, foreign arrays, async, p2p."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import RankFailure, run_ranks


def test_out_is_written_and_returned() -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.arange(6, dtype=np.int64) + comm.rank
        out = np.empty_like(x)
        res = comm.allreduce(x, out=out)
        assert res is out
        assert np.array_equal(x, np.arange(6) + comm.rank)
        return out

    for res in run_ranks(3, body):
        assert np.array_equal(res, 3 * np.arange(6) + 3)


@pytest.mark.parametrize(
    "algorithm",
    [
        a
        for a in plait.algorithms("allreduce")
        if not plait._algorithms.get("allreduce", a).needs_fabric
    ],
)
def test_allreduce_in_place(algorithm: str) -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.full((4, 3), comm.rank + 1, dtype=np.float64)
        res = comm.allreduce(x, out=x, algorithm=algorithm)
        assert res is x
        return x

    for res in run_ranks(5, body):
        assert np.array_equal(res, np.full((4, 3), 15.0))


@pytest.mark.parametrize("algorithm", plait.algorithms("alltoall"))
def test_alltoall_in_place(algorithm: str) -> None:
    size = 4

    def body(comm: plait.Communicator) -> Any:
        x = np.arange(size * 2, dtype=np.int32) + 100 * comm.rank
        return comm.alltoall(x, out=x, algorithm=algorithm)

    results = run_ranks(size, body)
    for r, res in enumerate(results):
        want = np.concatenate([np.arange(r * 2, r * 2 + 2) + 100 * q for q in range(size)])
        assert np.array_equal(res, want)


def test_reduce_in_place_on_root() -> None:
    def body(comm: plait.Communicator) -> Any:
        x = np.full(7, comm.rank, dtype=np.int32)
        return comm.reduce(x, root=1, out=x if comm.rank == 1 else None), x

    results = run_ranks(3, body)
    assert results[0][0] is None
    assert np.array_equal(results[1][0], np.full(7, 3))
    assert results[1][0] is results[1][1]


def test_non_contiguous_input_and_output() -> None:
    def body(comm: plait.Communicator) -> Any:
        base = np.arange(40, dtype=np.float32).reshape(8, 5) * (comm.rank + 1)
        x = base[::2, 1:4]  # strided view, 4x3
        out_base = np.zeros((4, 6), np.float32)
        out = out_base[:, ::2]  # strided output
        res = comm.allreduce(x, out=out)
        assert res is out
        assert np.array_equal(base, np.arange(40, dtype=np.float32).reshape(8, 5) * (comm.rank + 1))
        assert np.all(out_base[:, 1::2] == 0), "bytes between the strides were touched"
        fortran = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
        g = comm.allgather(fortran)
        return res, g

    for res, g in run_ranks(3, body):
        want = np.arange(40, dtype=np.float32).reshape(8, 5)[::2, 1:4] * 6
        assert np.array_equal(res, want)
        assert g.shape == (3, 2, 3)
        assert np.array_equal(g[2], np.arange(6).reshape(2, 3))


def test_broadcast_of_strided_view() -> None:
    def body(comm: plait.Communicator) -> Any:
        base = np.full((4, 6), -1.0)
        if comm.rank == 1:
            base[:] = np.arange(24.0).reshape(4, 6)
        view = base[::2, 1::2]
        assert comm.broadcast(view, root=1) is view
        return base

    for base in run_ranks(3, body):
        assert np.array_equal(base[::2, 1::2], np.arange(24.0).reshape(4, 6)[::2, 1::2])


def test_in_place_on_strided_view() -> None:
    def body(comm: plait.Communicator) -> Any:
        base = np.ones((6, 4), np.int64) * (comm.rank + 1)
        view = base[:, ::2]
        comm.allreduce(view, out=view)
        return base

    for base in run_ranks(2, body):
        assert np.array_equal(base[:, ::2], np.full((6, 2), 3))
        assert np.array_equal(base[:, 1::2], np.full((6, 2), 0) + base[:, 1::2])


class OnlyDLPack:
    """An object exposing only the DLPack protocol (as a torch CPU tensor does)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._a.__dlpack_device__()


def test_foreign_inputs_without_copy() -> None:
    def body(comm: plait.Communicator) -> Any:
        backing = np.full(5, comm.rank + 1.0)
        res = comm.allreduce(OnlyDLPack(backing), out=np.empty(5))
        # Zero copy: an in-place call through DLPack writes into the producer's memory.
        comm.allreduce(OnlyDLPack(backing), out=np.from_dlpack(OnlyDLPack(backing)))
        mv = memoryview(bytearray(np.full(3, comm.rank, np.int32).tobytes())).cast("i")
        from_buffer = comm.allgather(mv)
        from_list = comm.allreduce([1, 2, 3])
        return res, backing, from_buffer, from_list

    for res, backing, fb, fl in run_ranks(2, body):
        assert np.array_equal(res, np.full(5, 3.0))
        assert np.array_equal(backing, np.full(5, 3.0))
        assert np.array_equal(fb, [[0, 0, 0], [1, 1, 1]])
        assert np.array_equal(fl, [2, 4, 6])


def test_bytes_are_read_as_their_bytes() -> None:
    """bytes has the buffer protocol, but np.asarray made one string of it: "dtype |S5 is not
    supported" from send and allreduce, where a bytearray worked."""

    def body(comm: plait.Communicator) -> Any:
        total = comm.allreduce(b"\x01\x02")
        if comm.rank == 0:
            comm.send(b"hello", 1)
            return total, None
        return total, bytes(comm.recv(bytearray(5), 0))

    for r, (total, got) in enumerate(run_ranks(2, body)):
        assert total.dtype == np.uint8
        assert total.tolist() == [2, 4]
        assert got == (b"hello" if r == 1 else None)


def test_async_ops_return_work() -> None:
    def body(comm: plait.Communicator) -> Any:
        works = [comm.allreduce(np.full(10, i + comm.rank), async_op=True) for i in range(5)]
        b = comm.broadcast(np.full(3, comm.rank), root=1, async_op=True)
        blocking = comm.allreduce(np.ones(2))  # runs while the async ones may be in flight
        results = [w.wait() for w in works]
        assert all(w.done() for w in works)
        assert isinstance(works[0], plait.Work)
        return results, b.wait(timeout=30), blocking

    for results, b, blocking in run_ranks(3, body):
        for i, r in enumerate(results):
            assert np.array_equal(r, np.full(10, 3 * i + 3))
        assert np.array_equal(b, np.full(3, 1))
        assert np.array_equal(blocking, np.full(2, 3.0))


def test_work_reports_failure() -> None:
    finished = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            w = comm.allreduce(np.ones(3), async_op=True, timeout=0.5)
            with pytest.raises(plait.CommTimeout, match=r"waiting for rank\(s\) \[1\]"):
                w.wait()
            assert w.done()
            assert isinstance(w.exception(), plait.CommTimeout)
            finished.set()
        else:
            finished.wait(30)  # stay alive (but silent) so rank 0 times out

    run_ranks(2, body)


def test_point_to_point() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            comm.send(np.arange(5, dtype=np.int16), dst=1, tag=7)
            comm.send(np.arange(3, dtype=np.int16), dst=1, tag=7)
            comm.send(np.ones((2, 2)), dst=1, tag=1)
            return None
        first = comm.recv(np.empty(5, np.int16), src=0, tag=7)
        # Different tag, posted out of order: matched by tag, not arrival.
        other = comm.recv(np.empty((2, 2)), src=0, tag=1)
        second = comm.recv(np.empty(3, np.int16), src=0, tag=7)
        return first, second, other

    _, (first, second, other) = run_ranks(2, body)
    assert np.array_equal(first, np.arange(5))
    assert np.array_equal(second, np.arange(3))
    assert np.array_equal(other, np.ones((2, 2)))


def test_recv_size_mismatch_and_timeout() -> None:
    finished = threading.Event()

    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 0:
            # The receiver fails; the sender fails too where the receive was posted first (the
            # transports fail both ends of a mismatch they see at matching), else it succeeds.
            with contextlib.suppress(plait.MismatchError):
                comm.send(np.arange(5, dtype=np.int16), dst=1)
            finished.wait(30)
            return None
        with pytest.raises(plait.MismatchError, match=r"10 bytes.*6 bytes"):
            comm.recv(np.empty(3, np.int16), src=0)
        with pytest.raises(plait.CommTimeout, match="rank 0"):
            comm.recv(np.empty(3, np.int16), src=0, tag=4, timeout=0.2)
        finished.set()
        return None

    run_ranks(2, body)


def test_single_rank_init() -> None:
    with plait.init() as comm:
        assert (comm.rank, comm.size) == (0, 1)
        x = np.arange(4.0)
        assert np.array_equal(comm.allreduce(x), x)
        assert np.array_equal(comm.allgather(x), x[None])
        assert np.array_equal(comm.alltoall(x), x)
        comm.barrier()
    assert comm.closed
    with pytest.raises(plait.ClosedError):
        comm.allreduce(x)


def test_a_single_rank_names_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # It said "localhost", whatever PLAIT_HOST or the machine's name, unlike two ranks.
    monkeypatch.delenv("PLAIT_HOST", raising=False)
    with plait.init() as comm:
        assert comm.hosts == (socket.gethostname(),)
    monkeypatch.setenv("PLAIT_HOST", "node-a")
    with plait.init() as comm:
        assert (comm.host, comm.split_by_host().host) == ("node-a", "node-a")


def test_init_with_transport() -> None:
    from plait.transport.memory import MemoryFabric

    fabric = MemoryFabric(2)
    comm = plait.init(transport=fabric.endpoints[1])
    assert (comm.rank, comm.size) == (1, 2)
    with pytest.raises(ValueError, match="rank=0 disagrees"):
        plait.init(rank=0, transport=fabric.endpoints[1])


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"size": 1.5}, "size must be an int; got 1.5"),  # was "rank 0 of 1.5: cannot find"
        ({"rank": "0"}, "rank must be an int; got '0'"),  # was a comparison's TypeError
        ({"rank": True, "size": 2}, "rank must be an int; got True"),  # was rank 1
        ({"transport": 5}, "transport must be one of auto, shm, tcp, hybrid"),  # AttributeError
        ({"store": 5, "rank": 0, "size": 2}, "store must be a Store or a store URL"),
    ],
)
def test_init_checks_its_arguments_types(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(TypeError, match=re.escape(said)):
        plait.init(**kwargs)


def _init_in_processes(tmp_path: Path, *kwargs: dict[str, Any]) -> list[str]:
    """plait.init with each of ``kwargs`` in a process of its own (each process numbers its
    inits, and the ranks of one meet under its number), meeting in one file store: what
    each raised, as ``Type: message``, or ``ok``."""
    import subprocess
    import sys

    script = (
        "import json, sys, plait\n"
        "try:\n"
        "    plait.init(**json.loads(sys.argv[1])).close()\n"
        "    print('ok')\n"
        "except Exception as exc:\n"
        "    print(f'{type(exc).__name__}: {exc}')\n"
    )
    store = f"file://{tmp_path}/store"
    args = [json.dumps({"store": store, "size": 2, "timeout": 5, **kw}) for kw in kwargs]
    procs = [
        subprocess.Popen([sys.executable, "-c", script, a], stdout=subprocess.PIPE, text=True)
        for a in args
    ]
    return [p.communicate(timeout=60)[0].strip() for p in procs]


def test_init_says_the_ranks_were_given_different_transports(tmp_path: Path) -> None:
    """Each waited for the other on its own kind of link until the timeout, then blamed it
    for never announcing its segment or address."""
    got = _init_in_processes(
        tmp_path, {"rank": 0, "transport": "shm"}, {"rank": 1, "transport": "tcp"}
    )
    for said in got:
        assert said.startswith("RendezvousError: "), got
        assert "given different transports (rank 0: shm, rank 1: tcp)" in said


def test_init_says_two_processes_were_given_one_rank(tmp_path: Path) -> None:
    """Both waited out the timeout for the rank neither was, and named only that one."""
    got = _init_in_processes(tmp_path, {"rank": 0}, {"rank": 0})
    assert any("two processes were given the same rank" in said for said in got), got


def test_rank_failure_is_reported() -> None:
    def body(comm: plait.Communicator) -> Any:
        if comm.rank == 1:
            raise RuntimeError("boom")
        comm.allreduce(np.ones(3))

    with pytest.raises(RankFailure) as info:
        run_ranks(3, body)
    assert isinstance(info.value.errors[1], RuntimeError)
    assert isinstance(info.value.errors[0], plait.PeerLostError)
    # The message names every rank's error, the one that failed first (rank 1's) too.
    assert "rank 1 failed: RuntimeError('boom')" in str(info.value)
    assert "rank 0 failed: PeerLostError" in str(info.value)


def test_torch_cpu_tensors_without_copy() -> None:
    """A tensor in gives a tensor out; the tensor's memory is read and written in place.

    (tests/integration/test_tensor_io.py covers every collective and dtype.)
    """
    torch = pytest.importorskip("torch")

    def body(comm: plait.Communicator) -> Any:
        t = torch.full((3, 2), float(comm.rank + 1))
        res = comm.allreduce(t)
        view = np.from_dlpack(t)
        assert comm.allreduce(t, out=view) is view  # in place, into the tensor's memory
        return res, t

    for res, t in run_ranks(2, body):
        assert isinstance(res, torch.Tensor)
        assert torch.equal(res, torch.full((3, 2), 3.0))
        assert torch.equal(t, torch.full((3, 2), 3.0))


def test_ranks_of_one_host_name_on_different_machines_are_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cloned machines (or network namespaces) with one host name were taken for one host:
    the shared-memory set-up failed, each rank blaming the other for giving up or dying."""
    import threading
    from types import SimpleNamespace

    from plait import _meeting
    from plait.rendezvous.store import MemoryStore, PrefixStore

    monkeypatch.setattr(_meeting, "machine", lambda: f"boot-{threading.current_thread().name}")
    group = PrefixStore("init1", MemoryStore())
    got: list[Any] = [None, None]

    def one(r: int) -> None:
        try:
            got[r] = _meeting.meet(
                group,
                r,
                2,
                ("node", "auto", "f built-in"),
                5,
                5,
                SimpleNamespace(store_by_rank0=False),
            )
        except Exception as exc:
            got[r] = exc

    threads = [threading.Thread(target=one, args=(r,), name=f"m{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for exc in got:
        assert isinstance(exc, plait.RendezvousError), got
        assert "have one host name, 'node' (ranks [0]; ranks [1])" in str(exc)
        assert "(PLAIT_HOST)" in str(exc)


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("PLAIT_DEBUG", "bogus", "PLAIT_DEBUG='bogus' is not a level; expected info or detail"),
        ("PLAIT_RECOVERY", "abc", "PLAIT_RECOVERY='abc' is not a switch"),
        ("PLAIT_BIND", "maybe", "PLAIT_BIND='maybe' is not a switch"),
    ],
)
def test_settings_that_are_not_a_level_or_a_switch_are_refused(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, said: str
) -> None:
    """Each was ignored unseen: PLAIT_DEBUG=1 logged nothing, PLAIT_RECOVERY=false and
    PLAIT_BIND=false were read as on."""
    from plait.transport.memory import MemoryFabric

    monkeypatch.setenv(name, value)
    make: Any = (
        (lambda: plait.Communicator(MemoryFabric(1).endpoints[0]))
        if name == "PLAIT_DEBUG"
        else (lambda: plait.init(rank=0, size=1))
    )
    with pytest.raises(ValueError, match=re.escape(said)):
        make()


def test_tcp_streams_left_empty_is_one_and_a_bad_one_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from plait.transport.tcp import _streams_from

    monkeypatch.setenv("PLAIT_TCP_STREAMS", " ")
    assert _streams_from(None) == 1  # "'' is not an integer", where every setting reads empty
    monkeypatch.setenv("PLAIT_TCP_STREAMS", "0")
    with pytest.raises(ValueError, match=r"PLAIT_TCP_STREAMS='0': must be between 1 and"):
        _streams_from(None)
