"""Ranks that meet through the store rank 0 serves (MASTER_ADDR) and differ in a setting all
say so, naming the setting: rank 0 raised as soon as it had read the others' settings, and
its process ended, taking the store along while rank 1 still read them, so rank 1 said
"get('plait/init1/host/1') failed: the connection broke" (in about half of the runs).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from launch_helpers import clean_env, free_port_pair

# Rank 1 lets rank 0 leave first, wherever rank 0 can: once its own wait for the hosts has
# ended, it waits until rank 0's store is gone, or LET_GO seconds, before it reads them.
RANK = """
import os, sys, time, plait
import plait._meeting as meeting
from plait.errors import CommError

real = meeting.wait_ranks

def wait_ranks(store, keys, *args, **kwargs):
    real(store, keys, *args, **kwargs)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:  # a poll: rank 0's store has no event to wait on
        try:
            store.check(keys)
        except CommError:
            return
        time.sleep(0.05)

if os.environ["PLAIT_RANK"] == "1":
    meeting.wait_ranks = wait_ranks
try:
    plait.init(timeout=20)
except plait.CommError as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
"""
#: Seconds rank 1 gives rank 0 to leave before it reads the hosts.
LET_GO = "2"


@pytest.mark.parametrize(
    ("rank0", "said"),
    [
        ({"PLAIT_ALGO": "allreduce:ring:0-"}, "the ranks follow different settings"),
        ({"PLAIT_TRANSPORT": "tcp"}, "the ranks were given different transports"),
    ],
    ids=["settings", "transport"],
)
def test_every_rank_says_which_setting_differs_where_rank_0_serves_the_store(
    rank0: dict[str, str], said: str
) -> None:
    port = free_port_pair()
    base = {
        "PLAIT_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PLAIT_RULES": os.devnull,
        "PLAIT_PROFILE": os.devnull + "/none",
    }
    envs = [clean_env(**base, PLAIT_RANK="0", **rank0), clean_env(**base, PLAIT_RANK="1")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, LET_GO],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in envs
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, out in enumerate(outs):
        assert out.startswith(f"RendezvousError: rank {r}: {said}"), out
        assert "store" not in out, out
