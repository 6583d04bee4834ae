"""Point to point between real processes, over shared memory, TCP and both at once.

``p2p_check.py`` runs inside ``plait run`` (master-worker with ANY_SOURCE,
ordering, probe, sendrecv rings, cancel, sub-communicators); a second job
shows that a rank that dies fails only the requests that need it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_faults import plait_run as run_script
from test_multiprocess import plait_run

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.multiprocess


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("transport", "nproc"), [("shm", 3), ("shm", 4), ("tcp", 2), ("tcp", 5)])
def test_point_to_point(transport: str, nproc: int) -> None:
    res = plait_run(["-n", str(nproc), "--transport", transport, str(HERE / "p2p_check.py")])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"p2p ok on {nproc} ranks over" in res.stdout


DEAD_PEER = """
    import os, numpy as np, plait
    comm = plait.init(timeout=60)
    r = comm.rank
    if r == 2:  # wait for the word, then die without closing anything
        comm.recv(np.empty(1), 0, tag=9)
        os._exit(0)
    if r == 1:
        comm.recv(np.empty(1), 0, tag=9)
        comm.send(np.array([11.0]), 0, tag=1)
        comm.send(np.array([12.0]), 0, tag=2)
        comm.recv(np.empty(1), 0, tag=9)
        comm.close()
        raise SystemExit(0)
    from_two = comm.irecv(np.empty(1), 2, tag=1)
    from_one = comm.irecv(np.empty(1), 1, tag=1)
    from_any = comm.irecv(np.empty(1), plait.ANY_SOURCE, tag=2)
    comm.send(np.zeros(1), 2, tag=9)
    try:
        from_two.wait()
        raise SystemExit("the receive from the dead rank completed")
    except plait.PeerLostError as exc:
        print("from_two failed:", exc, flush=True)
    assert not from_any.done(), from_any
    comm.send(np.zeros(1), 1, tag=9)
    assert from_one.wait()[0] == 11.0
    assert from_any.wait()[0] == 12.0 and from_any.status.source == 1, from_any.status
    comm.send(np.zeros(1), 1, tag=9)
    try:
        comm.recv(np.empty(1), plait.ANY_SOURCE, plait.ANY_TAG)
        raise SystemExit("a receive from nobody completed")
    except plait.PeerLostError as exc:
        print("any source failed:", exc, flush=True)
    print("dead peer ok", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp", "hybrid"])
def test_a_dead_peer_fails_only_the_requests_that_need_it(tmp_path: Path, transport: str) -> None:
    res, elapsed = run_script(["-n", "3", "--transport", transport], DEAD_PEER, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "dead peer ok" in res.stdout, out[-3000:]
    assert "from_two failed: rank 0: irecv from rank 2 (tag 1):" in res.stdout, out[-3000:]
    assert "any source failed:" in res.stdout, out[-3000:]
    assert elapsed < 50, f"took {elapsed:.1f} s: a lost peer was noticed late"


ARRIVING = """
    import numpy as np, plait
    comm = plait.init(timeout=60)
    n = 64 << 20
    if comm.rank == 0:
        comm.send(np.full(n, 7, np.uint8), 1, tag=3)
        comm.send(np.ones(1), 1, tag=4)
    else:
        comm.probe(0, 3)  # the message is there: its receive matches it at once
        got = comm.recv(np.empty(n, np.uint8), 0, tag=3, timeout=0.001)
        assert (got == 7).all()
        assert comm.recv(np.empty(1), 0, tag=4)[0] == 1.0
        print("arrived whole", flush=True)
"""


POLLS = """
    import os, select, time, numpy as np, plait
    comm = plait.init(timeout=60)
    if comm.rank == 0:
        comm.send(np.arange(3.0), 1, tag=1)
        req = comm.isend(np.ones(1), 1, tag=2)
    else:
        req = comm.irecv(np.empty(3), 0, tag=1)
    deadline = time.monotonic() + 30
    while True:  # wait(0) looks once, as test() does: it made no progress and never ended
        try:
            req.wait(0)
            break
        except plait.CommTimeout:
            assert time.monotonic() < deadline, "wait(0) never completed the request"
            select.select([], [], [], 0.001)
    if comm.rank == 1:
        assert comm.recv(np.empty(1), 0, tag=2)[0] == 1.0
    pids = comm.allgather_object(os.getpid())
    if comm.rank == 1:
        os._exit(0)  # dies without closing anything
    gone = os.pidfd_open(pids[1])
    select.select([gone], [], [], 30)  # rank 1's process has ended
    time.sleep(1.1)  # longer than the shared-memory link's check of its peers' processes
    try:
        comm.send(np.ones(1), 1, tag=5)  # fits the ring: it completed, and the message was lost
        raise SystemExit("a send to a rank dead for a second succeeded")
    except plait.PeerLostError as exc:
        assert exc.lost_rank == 1, exc.lost_rank
    for probe in (lambda: comm.probe(1, 5), lambda: comm.iprobe(1, 5)):
        try:
            probe()
            raise SystemExit("a probe of a dead rank succeeded")
        except plait.PeerLostError as exc:  # its lost_rank was None
            assert exc.lost_rank == 1, exc.lost_rank
    print("polls and losses ok", flush=True)
"""


SEND_TIMEOUT = """
    import os, numpy as np, plait
    fifo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timed-out")
    if os.environ["PLAIT_RANK"] == "1":
        os.mkfifo(fifo)  # before init: rank 0 opens it after init
    comm = plait.init(timeout=60)
    n = 4_000_000
    if comm.rank == 0:  # rank 1 is in no call of plait's until this send has timed out
        try:
            comm.send(np.full(n, 7.0), 1, tag=1, timeout=0.5)
            raise SystemExit("a send nobody received completed")
        except plait.CommTimeout as exc:
            assert "its message may still arrive" in str(exc), exc
        with open(fifo, "w") as f:
            f.write("timed out")
        comm.send(np.ones(1), 1, tag=9)
    else:
        with open(fifo) as f:  # blocks until rank 0 opens it
            f.read()
        comm.recv(np.empty(1), 0, tag=9)
        st = comm.iprobe(0, 1)
        if st is not None:  # the part that had left was sent to its end
            assert st.nbytes == 8 * n, st
            assert (comm.recv(np.empty(n), 0, tag=1) == 7.0).all()
        print("send timeout said so;", "arrived" if st is not None else "withdrawn", flush=True)
"""


WITHDRAWN = """
    import os, numpy as np, plait
    fifo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timed-out")
    if os.environ["PLAIT_RANK"] == "1":
        os.mkfifo(fifo)  # before init: rank 0 opens it after init
    comm = plait.init(timeout=60)
    if comm.rank == 0:  # rank 1 is in no call of plait's until both sends are made
        try:
            comm.send(np.zeros(4_000_000), 1, tag=1, timeout=0.5)
        except plait.CommTimeout:
            pass
        req = comm.isend(np.full(3, 5.0), 1, tag=1)  # behind the first, over shared memory
        req.test()  # a round of progress: out go the withdrawal and this one, over TCP
        with open(fifo, "w") as f:
            f.write("sent")
        req.wait()
    else:
        with open(fifo) as f:  # blocks until rank 0 opens it
            f.read()
        st = comm.probe(0, 1)
        if st.count == 4_000_000:  # over shared memory the first message arrives whole
            comm.recv(np.empty(st.count), 0, 1)
            st = comm.probe(0, 1)
        assert st.count == 3, st  # over TCP it was withdrawn: the probe saw it all the same
        assert (comm.recv(np.empty(st.count), 0, 1) == 5.0).all()
        print("probed what was there", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_probe_describes_no_message_its_sender_withdrew(tmp_path: Path, transport: str) -> None:
    """Note [a probed message withdrawn]: a probe that completed as a withdrawn message was
    announced described it, and the receive made from its status took the next message at
    the wrong size (MismatchError) and lost it."""
    res, _ = run_script(["-n", "2", "--transport", transport], WITHDRAWN, tmp_path)
    assert "probed what was there" in res.stdout, (res.stdout + res.stderr)[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_send_that_times_out_says_its_message_may_still_arrive(
    tmp_path: Path, transport: str
) -> None:
    """A blocking send that timed out said only that the peer had not received, and over
    shared memory its message then arrived whole: the part in the ring is sent to its end
    (a send is not undone), and the error now says the message may still arrive."""
    res, _ = run_script(["-n", "2", "--transport", transport], SEND_TIMEOUT, tmp_path)
    out = res.stdout + res.stderr
    assert "send timeout said so;" in res.stdout, out[-3000:]
    if transport == "shm":
        assert "send timeout said so; arrived" in res.stdout, out[-3000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize(
    ("script", "options", "said"),
    [
        # Its deadline passed while 64 MiB arrived: the rest was dropped, the message lost to
        # every later receive, and the sender told it had succeeded (Note [a message
        # arriving at the deadline]).
        pytest.param(ARRIVING, [], "arrived whole", id="arriving-at-the-deadline"),
        pytest.param(POLLS, ["--enable-recovery"], "polls and losses ok", id="polls-and-losses"),
    ],
)
def test_point_to_point_at_deadlines_and_losses(
    tmp_path: Path, transport: str, script: str, options: list[str], said: str
) -> None:
    res, _ = run_script(["-n", "2", *options, "--transport", transport], script, tmp_path)
    out = res.stdout + res.stderr
    assert said in res.stdout, out[-3000:]


OBJECT_CUT_SHORT = """
    import numpy as np, plait
    comm = plait.init(timeout=60)
    big = np.arange(8 << 20, dtype=np.float64)  # 64 MiB: a message of its own, sent on demand
    def outcome(fn):
        try:
            fn()
            return "ok"
        except plait.CommError as exc:
            said = str(exc)
            told = " told" if "0's send_object on this tag failed partway (it said" in said else ""
            return type(exc).__name__ + (" spoiled" if "failed partway" in said else "") + told
    if comm.rank == 0:  # rank 1 receives only once this send has timed out
        print("send", outcome(lambda: comm.send_object({"a": big}, 1, tag=3, timeout=0.5)))
        comm.send(np.ones(1), 1, tag=9)
        print("again", outcome(lambda: comm.send_object("second", 1, tag=3)))
        comm.send_object("on another tag", 1, tag=4)
    else:
        comm.recv(np.empty(1), 0, tag=9)
        print("recv", outcome(lambda: comm.recv_object(0, tag=3, timeout=2)))
        print("again", outcome(lambda: comm.recv_object(0, tag=3, timeout=2)))
        print("other", comm.recv_object(0, tag=4))
    comm.barrier()  # rank 0 stays until rank 1 has timed out
"""


@pytest.mark.timeout(120)
def test_an_object_cut_short_spoils_its_tag_on_both_sides(tmp_path: Path) -> None:
    """A send_object that timed out over TCP after its first messages had left: the next
    object on the tag was read as the rest of it (MismatchError on the receiver, twice,
    saying the ranks disagree on the call), and the sender's next send_object 'worked'
    (Note [an object cut short] in plait._object_methods). Then the receive waited out
    its whole timeout for the part the sender had withdrawn, and blamed a dead or absent
    peer: the sender now tells it that it cut the object short."""
    res, _ = run_script(
        ["-n", "2", "--transport", "tcp", "--tag-output"], OBJECT_CUT_SHORT, tmp_path
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(res.stdout.splitlines()) == [
        "[0]: again CommError spoiled",
        "[0]: send CommTimeout",
        "[1]: again CommError spoiled",
        "[1]: other on another tag",
        "[1]: recv CommError spoiled told",
    ], res.stdout
