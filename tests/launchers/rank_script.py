"""One rank of a launcher test: a bare ``plait.init()``, a few collectives, a JSON report.

Usage: ``rank_script.py MODE`` under any launcher, with PLAIT_TEST_OUT naming a
directory for the report ``rank-<rank>.json``. Modes:

- ``check``: allreduce, allgather, broadcast and split_by_host, checked here
  against the expected values; the report says what the environment and the
  communicator told.
- ``twice``: two communicators from two bare ``init()`` calls, open together.
- ``torch``: ``check`` plus torch.distributed (gloo) through torch's own store
  on MASTER_PORT, in the same processes.
- ``fail``: after one allreduce, rank 1 exits with code 7 without closing; the
  others start a large allreduce, print ``lost`` and exit 5 on PeerLostError.

PLAIT_TEST_HOSTS=k makes the ranks claim k hosts (PLAIT_HOST), in rank blocks.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import plait
from plait._init import detect_launch


def check(comm: plait.Communicator) -> dict:
    r, n = comm.rank, comm.size
    total = comm.allreduce(np.arange(6, dtype=np.float64) + r)
    assert np.array_equal(total, np.arange(6) * n + n * (n - 1) / 2), total
    rows = comm.allgather(np.array([r, r * r], np.int64))
    assert rows.tolist() == [[k, k * k] for k in range(n)], rows
    b = np.full(3, r, np.int32)
    comm.broadcast(b, root=n - 1)
    assert b.tolist() == [n - 1] * 3, b
    local = comm.split_by_host()
    mates = [k for k in range(n) if comm.hosts[k] == comm.host]
    sub_sum = int(local.allreduce(np.array([r], np.int64))[0])
    assert sub_sum == sum(mates), (sub_sum, mates)
    assert (local.rank, local.size) == (comm.local_rank, comm.local_size)
    local.close()
    return {
        "local_rank": comm.local_rank,
        "local_size": comm.local_size,
        "cross_rank": comm.cross_rank,
        "cross_size": comm.cross_size,
        "host": comm.host,
        "transport": type(comm._transport).__name__,
        "sub_sum": sub_sum,
    }


def record_shm_jobs(comm: plait.Communicator) -> None:
    """Write the job tokens of this rank's shared-memory segments for the leak check.

    The launcher tests check that none of *this job's* segments stay in /dev/shm (other
    plait jobs on the machine may have segments of their own at any moment).
    """
    t = comm._transport
    shm = t if hasattr(t, "_create_segment") else getattr(t, "shm", None)
    tokens = [shm.job] if shm is not None and shm.job else []
    out = os.environ["PLAIT_TEST_OUT"]
    with open(os.path.join(out, f"shm-{comm.rank}-{os.getpid()}-{id(comm)}.txt"), "w") as f:
        f.write("\n".join(tokens))


def main() -> None:
    mode = sys.argv[1]
    info = detect_launch()
    hosts = int(os.environ.get("PLAIT_TEST_HOSTS", "0"))
    if hosts:
        os.environ["PLAIT_HOST"] = f"host{info.rank * hosts // info.size}"
    report: dict = {
        "rank": info.rank,
        "size": info.size,
        "launcher": info.launcher,
        "env_local_rank": info.local_rank,
        "env_local_size": info.local_size,
        "store_url": info.store_url,
        "store_is_server": info.store_is_server,
        "store_is_temp": info.store_is_temp,
        "job_id": info.job_id,
        "pid": os.getpid(),
        "pmix_namespace": os.environ.get("PMIX_NAMESPACE"),
    }
    if mode == "fail":
        comm = plait.init()
        record_shm_jobs(comm)
        comm.allreduce(np.ones(10))
        if comm.rank == 1:
            os._exit(7)  # dies without closing
        try:
            comm.allreduce(np.ones(1 << 22))
        except plait.PeerLostError as exc:
            print("lost:", exc, flush=True)
            raise SystemExit(5) from None
        raise SystemExit("the allreduce succeeded without rank 1")
    if mode == "agree":  # what agree says where init let its store go (a temp-dir file store)
        with plait.init() as comm:
            try:
                report["agree"] = repr(comm.agree())
            except plait.UnsupportedError as exc:
                report["agree"] = str(exc)
        with open(os.path.join(os.environ["PLAIT_TEST_OUT"], f"rank-{info.rank}.json"), "w") as f:
            json.dump(report, f)
        return
    if mode == "twice":
        first = plait.init()
        second = plait.init()
        with first, second:
            record_shm_jobs(first)
            record_shm_jobs(second)
            report.update(check(second))
            report["first"] = check(first)
    else:
        with plait.init() as comm:
            record_shm_jobs(comm)
            assert comm.rank == info.rank
            assert comm.size == info.size
            report.update(check(comm))
            if mode == "torch":
                import torch
                import torch.distributed as dist

                dist.init_process_group("gloo")  # torch's store: MASTER_ADDR:MASTER_PORT
                t = torch.full((4,), float(comm.rank))
                dist.all_reduce(t)
                mine = comm.allreduce(torch.full((4,), float(comm.rank)))
                assert np.array_equal(t.numpy(), mine), (t, mine)
                report["torch_sum"] = float(t[0])
                dist.destroy_process_group()
    out = os.environ["PLAIT_TEST_OUT"]
    with open(os.path.join(out, f"rank-{info.rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
