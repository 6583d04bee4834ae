"""One rank of the torch backend's jobs in which ranks leave; run by ``plait run -n N``.

Modes (first argument):
    monitored  ``plait.torch.monitored_barrier()`` as the last call before
               ``dist.destroy_process_group()``, in several rounds (a new
               default group each): rank 0 serves the store under plait run, so
               it must not leave while the others still read its verdict. Each
               rank prints ``rank R: round K clean exit``.
    lost       three ranks; global rank 2 of the sub-group of global ranks
               [1, 2] exits, and global rank 1's calls on the sub-group fail
               naming the ranks by their global ranks too. Prints ``rank R:
               lost passed``; the ranks leave with ``os._exit`` (the default
               group has lost a rank: nothing more to wait for).
    outside    three ranks; a rank outside a sub-group calls
               ``plait.torch.monitored_barrier`` on it (returns, as torch's
               does) and ``plait.torch.communicator`` (refused, saying so); a
               sub-group one of whose ranks never comes names it by its global
               rank too. Prints ``rank R: outside passed``.
    again      ``dist.destroy_process_group()`` and ``init_process_group`` again,
               in several rounds, holding each round's sub-group (of another size
               in the first round): torch gives the new groups the old ones'
               namespaces in a store that is still there (torchrun's, or one the
               held group keeps). Each rank prints
               ``rank R: round K again``.
"""

from __future__ import annotations

import os
import re
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import plait
import plait.torch

#: Rounds of the ``monitored`` mode: the race it guards against lost most of them.
ROUNDS = 3


def monitored() -> None:
    for k in range(ROUNDS):
        dist.init_process_group("plait")
        rank = dist.get_rank()
        t = torch.ones(1)
        dist.all_reduce(t)
        plait.torch.monitored_barrier()
        dist.destroy_process_group()
        print(f"rank {rank}: round {k} clean exit", flush=True)


def expect(kind: type[BaseException], words: tuple[str, ...], fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except kind as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            raise AssertionError(f"message lacks {missing}: {exc}") from exc
        return exc
    raise AssertionError(f"expected {kind.__name__} ({words})")


def lost() -> None:
    dist.init_process_group("plait")
    rank = dist.get_rank()
    assert dist.get_world_size() == 3
    sub = dist.new_group([1, 2], backend="plait")
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 2:
        os._exit(0)
    if rank == 1:
        # global rank 1 is the sub-group's rank 0; global rank 2, which left, its rank 1
        exc = expect(
            plait.PeerLostError,
            ("rank 0 (global rank 1): ", "rank 1 (global rank 2) "),
            lambda: dist.all_reduce(torch.ones(4), group=sub),
        )
        assert exc.lost_rank == 1, exc.lost_rank  # plait's attribute: the group's rank
        # its dump is the sub-group's own, not global rank 0's rank0.json of the world
        assert re.search(r"flight recorder dump: \S*/comm[0-9a-f]+\.rank0\.json", str(exc)), exc
        # the sub-group is unusable now: refused at the call or at its wait()
        expect(
            plait.CommError,
            ("rank 0 (global rank 1): ", "(global rank 2)"),
            lambda: dist.all_reduce(torch.ones(4), group=sub, async_op=True).wait(),
        )
        store.set("lost-checked", "1")
    else:
        store.wait(["lost-checked"], timedelta(seconds=60))
    print(f"rank {rank}: lost passed", flush=True)
    os._exit(0)


def outside() -> None:
    dist.init_process_group("plait")
    rank = dist.get_rank()
    assert dist.get_world_size() == 3
    pair = dist.new_group([0, 1], backend="plait")
    # A rank outside the group returns with torch's warning, as from dist.monitored_barrier
    # (it raised TypeError, calling the default group no plait group).
    plait.torch.monitored_barrier(group=pair, timeout=timedelta(seconds=30))
    if rank == 2:
        said = ("this rank is not in the group",)
        expect(ValueError, said, lambda: plait.torch.communicator(pair))
    # Global rank 2 never makes this group: global rank 1, its rank 0, waits for its rank 1,
    # which its error named as plain "rank(s) [1]" (rank 1 itself?) and blamed plait.init.
    store = dist.distributed_c10d._get_default_store()
    if rank != 2:
        if rank == 1:
            exc = expect(
                plait.RendezvousError,
                ("rank 0 (global rank 1)", "rank(s) [1] (global rank(s) [2])"),
                lambda: dist.new_group([1, 2], backend="plait", timeout=timedelta(seconds=3)),
            )
            notes = "".join(getattr(exc, "__notes__", ()))
            assert "dist.new_group" in notes, notes
            store.set("outside-checked", "1")
        else:
            dist.new_group([1, 2], backend="plait", timeout=timedelta(seconds=3))
    store.wait(["outside-checked"], timedelta(seconds=60))
    print(f"rank {rank}: outside passed", flush=True)
    os._exit(0)


def again() -> None:
    held = []  # each round's sub-group, kept as user code may keep it
    for k in range(ROUNDS):
        dist.init_process_group("plait", timeout=timedelta(seconds=30))
        rank = dist.get_rank()
        size = dist.get_world_size()
        # A sub-group of one rank first, then of all: each round's takes the namespace of
        # the round before's, with another size.
        members = [0] if k == 0 else list(reversed(range(size)))
        held.append(dist.new_group(members))
        t = torch.ones(2)
        dist.all_reduce(t)
        if rank in members:
            dist.all_reduce(t, group=held[-1])
        want = size * len(members) if rank in members else size
        assert t.tolist() == [want, want], t
        dist.destroy_process_group()
        print(f"rank {rank}: round {k} again", flush=True)


if __name__ == "__main__":
    modes = {"monitored": monitored, "lost": lost, "outside": outside, "again": again}
    modes[sys.argv[1]]()
