"""Run inside every rank by ``plait run``: point to point as MPI users know it.

A master-worker queue with ANY_SOURCE, per-sender ordering under wildcards,
probe-then-receive of messages of unknown size, a sendrecv ring and a
non-periodic shift with PROC_NULL, cancel, and wildcards in a sub-communicator.
Exits non-zero, naming the part, on the first wrong result.
"""

from __future__ import annotations

import numpy as np

import plait


def _check(name: str, ok: bool, detail: object = "") -> None:
    if not ok:
        raise SystemExit(f"p2p_check: {name} is wrong: {detail}")


def master_worker(comm: plait.Communicator) -> None:
    work, result, stop = 1, 2, 3
    tasks = list(range(5 * comm.size))
    if comm.rank == 0:
        queue = list(tasks)
        squares: dict[int, int] = {}
        busy = 0
        for w in range(1, comm.size):
            if queue:
                comm.send(np.array([queue.pop()]), w, work)
                busy += 1
            else:
                comm.send(np.array([-1]), w, stop)
        while busy:
            st = plait.Status()
            got = comm.recv(np.empty(2, np.int64), plait.ANY_SOURCE, result, status=st)
            squares[int(got[0])] = int(got[1])
            if queue:
                comm.send(np.array([queue.pop()]), st.source, work)
            else:
                comm.send(np.array([-1]), st.source, stop)
                busy -= 1
        _check("master-worker", squares == {t: t * t for t in tasks}, squares)
        return
    while True:
        st = plait.Status()
        task = comm.recv(np.empty(1, np.int64), 0, plait.ANY_TAG, status=st)
        if st.tag == stop:
            return
        comm.send(np.array([task[0], task[0] ** 2]), 0, result)


def ordering(comm: plait.Communicator) -> None:
    n = 20
    if comm.rank != 0:
        reqs = [comm.isend(np.array([comm.rank, i]), 0, tag=10 + i % 2) for i in range(n)]
        plait.wait_all(reqs)
        return
    last = dict.fromkeys(range(1, comm.size), -1)
    for _ in range(n * (comm.size - 1)):
        st = plait.Status()
        src, i = comm.recv(np.empty(2, np.int64), plait.ANY_SOURCE, plait.ANY_TAG, status=st)
        _check("ordering (source)", st.source == src and st.tag == 10 + i % 2, (st, src, i))
        _check("ordering (per sender)", i == last[int(src)] + 1, (src, i, last))
        last[int(src)] = int(i)


def probe_then_recv(comm: plait.Communicator) -> None:
    if comm.rank != 0:
        n = 1000 * comm.rank + comm.rank  # unknown to rank 0
        comm.send(np.full(n, comm.rank, np.float32), 0, tag=7)
        return
    seen = set()
    for _ in range(comm.size - 1):
        st = comm.probe(plait.ANY_SOURCE, 7)
        _check("probe", st.dtype == np.float32 and st.count == 1001 * st.source, st)
        buf = comm.recv(np.empty(st.count, st.dtype), st.source, st.tag)
        _check("probe-then-recv", bool((buf == st.source).all()), st)
        seen.add(st.source)
    _check("probe senders", seen == set(range(1, comm.size)), seen)


def rings(comm: plait.Communicator) -> None:
    r, p = comm.rank, comm.size
    x = np.arange(70_000, dtype=np.float64) + r  # large enough to leave the eager path
    got = comm.sendrecv(x, (r + 1) % p, np.empty_like(x), (r - 1) % p, 4, 4)
    _check("sendrecv ring", bool((got == np.arange(70_000) + (r - 1) % p).all()))
    right = r + 1 if r + 1 < p else plait.PROC_NULL
    left = r - 1 if r > 0 else plait.PROC_NULL
    buf = np.full(3, -1)
    st = plait.Status()
    comm.sendrecv(np.full(3, r), right, buf, left, status=st)
    want = [-1] * 3 if r == 0 else [r - 1] * 3
    _check("shift", buf.tolist() == want and st.source == left, (buf, st))


def cancel(comm: plait.Communicator) -> None:
    req = comm.irecv(np.empty(1), plait.ANY_SOURCE, 99)  # nobody sends tag 99
    _check("cancel (pending)", not req.test())
    req.cancel()
    _check("cancel", req.cancelled and req.done(), req)
    comm.barrier()


def sub_communicator(comm: plait.Communicator) -> None:
    sub = comm.split(comm.rank % 2, key=-comm.rank)
    if sub.rank == 0:
        got = {}
        for _ in range(sub.size - 1):
            st = plait.Status()
            world = sub.recv(np.empty(1, np.int64), plait.ANY_SOURCE, plait.ANY_TAG, status=st)
            got[st.source] = (int(world[0]), st.tag)
        members = sorted((r for r in range(comm.size) if r % 2 == comm.rank % 2), reverse=True)
        want = {g: (members[g], g) for g in range(1, len(members))}
        _check("sub-communicator", got == want, (got, want))
    else:
        sub.send(np.array([comm.rank]), 0, tag=sub.rank)
    sub.close()


def main() -> int:
    with plait.init(timeout=60) as comm:
        for part in (master_worker, ordering, probe_then_recv, rings, cancel, sub_communicator):
            part(comm)
            comm.barrier()
        if comm.rank == 0:
            print(f"p2p ok on {comm.size} ranks over {type(comm._transport).__name__}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
