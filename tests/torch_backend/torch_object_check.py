"""The ``objects`` mode of ``torch_rank_check.py``: torch's ``*_object`` functions on plait.

Every one of ``all_gather_object``, ``gather_object``, ``broadcast_object_list``,
``scatter_object_list``, ``send_object_list`` and ``recv_object_list`` is
called the same way on the "plait" default group and on a "gloo" group of the
same job, and must give the same objects, return values and errors: objects
with numpy arrays and tensors, one of several MiB, roots given as global
ranks and as group ranks, and on sub-groups whose group ranks are not the
global ones. A spy on torch's ``_object_to_tensor`` (which torch's own
functions call for every object) shows that plait groups never reach torch's
pickling path and gloo groups always do.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch_uneven_check import equal  # its sibling in this folder (the ranks' sys.path)

import plait.torch
from plait.torch import _objects

#: Elements of the large array rank 0 puts in its objects (8 MiB of float32).
BIG = 2 * 1024 * 1024


def obj(rank: int, salt: int = 0) -> dict[str, Any]:
    """An object of rank-dependent size: text, a numpy array, a tensor; rank 0's is large."""
    return {
        "rank": rank,
        "salt": salt,
        "text": "x" * (rank * 100 + salt),
        "array": np.arange(BIG if rank == 0 else rank * 300 + salt, dtype=np.float32),
        "strided": np.arange(40, dtype=np.int64).reshape(5, 8)[:, ::3],
        "tensor": torch.arange(rank * 70 + salt, dtype=torch.float64),
    }


def agree(got: Any, want: Any, what: str) -> None:
    if not equal(got, want):
        raise AssertionError(f"{what}: got {got!r:.300}, expected {want!r:.300}")


class Spy:
    """Counts the calls of torch's ``_object_to_tensor`` and ``_tensor_to_object``.

    torch's own object functions pickle and unpickle through them (a source
    only pickles, a receiver only unpickles); plait's path never calls them.
    """

    NAMES = ("_object_to_tensor", "_tensor_to_object")

    def __init__(self) -> None:
        self.calls = 0

    @contextmanager
    def watching(self) -> Iterator[Spy]:
        real = {name: getattr(c10d, name) for name in self.NAMES}

        def counting(fn: Callable[..., Any]) -> Callable[..., Any]:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                return fn(*args, **kwargs)

            return counted

        for name, fn in real.items():
            setattr(c10d, name, counting(fn))
        try:
            yield self
        finally:
            for name, fn in real.items():
                setattr(c10d, name, fn)


def both(
    plait_group: Any, gloo_group: Any, call: Callable[[Any], Any], what: str
) -> tuple[Any, Any]:
    """``call(group)`` on the plait group (through plait), then on gloo (through torch)."""
    with Spy().watching() as spy:
        on_plait = call(plait_group)
    assert spy.calls == 0, f"{what}: the plait group went through torch's pickling"
    with Spy().watching() as spy:
        on_gloo = call(gloo_group)
    assert spy.calls > 0, f"{what}: the gloo group did not go through torch's function"
    return on_plait, on_gloo


def error(call: Callable[[], Any]) -> str:
    """``type: message`` of what ``call`` raises ("" if nothing)."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def check_objects(size: int, rank: int) -> None:
    """The six functions on the default group against gloo, then on sub-groups."""
    assert _objects.installed()
    assert dist.all_gather_object.__wrapped__ is _objects.original("all_gather_object")
    world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    check_functions(size, rank, world, gloo, list(range(size)))
    # a sub-group without rank 0: its group ranks are not the global ones
    members = list(range(1, size)) if size > 2 else [1]
    sub = dist.new_group(members, backend="plait")
    sub_gloo = dist.new_group(members, backend="gloo")
    if rank in members:
        check_functions(len(members), members.index(rank), sub, sub_gloo, members)
    else:
        box: list[Any] = ["untouched"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.all_gather_object(box, obj(rank), group=sub)  # torch's: warns, returns
        assert box == ["untouched"], box
        assert any("does not belong to the given group" in str(w.message) for w in caught)
    check_order(size, rank)
    dist.barrier(group=gloo)
    for g in (sub_gloo, sub, gloo):
        dist.destroy_process_group(g)


def check_functions(size: int, rank: int, pg: Any, gloo: Any, members: list[int]) -> None:
    """Every function on ``pg`` (plait) and ``gloo``, ``members`` the groups' global ranks."""
    where = f"global rank {members[rank]} on {members}"
    every = [obj(members[r]) for r in range(size)]

    def all_gather(g: Any) -> list[Any]:
        out: list[Any] = [None] * size
        assert dist.all_gather_object(out, every[rank], group=g) is None
        return out

    got, want = both(pg, gloo, all_gather, "all_gather_object")
    agree(got, want, f"{where}: all_gather_object")
    agree(got, every, f"{where}: all_gather_object against the objects")

    for root in sorted({0, size - 1}):
        glob = members[root]
        for how in ({"dst": glob}, {"group_dst": root}):

            def gather(g: Any, how: dict[str, int] = how, root: int = root) -> Any:
                out = [None] * size if rank == root else None
                assert dist.gather_object(every[rank], out, group=g, **how) is None
                return out

            got, want = both(pg, gloo, gather, f"gather_object {how}")
            agree(got, want, f"{where}: gather_object {how}")
            agree(got, every if rank == root else None, f"{where}: gather_object {how}")

        for how in ({"src": glob}, {"group_src": root}):

            def bcast(
                g: Any, how: dict[str, int] = how, root: int = root, glob: int = glob
            ) -> list[Any]:
                mine = [obj(glob, 3), "two", {3: (4, 5)}]
                box = mine if rank == root else [None, None, None]
                assert dist.broadcast_object_list(box, group=g, **how) is None
                if rank == root:  # the source keeps its own objects
                    assert all(a is b for a, b in zip(box, mine, strict=True))
                return box

            got, want = both(pg, gloo, bcast, f"broadcast_object_list {how}")
            agree(got, want, f"{where}: broadcast_object_list {how}")

            def scatter(g: Any, how: dict[str, int] = how, root: int = root) -> list[Any]:
                parts = [obj(members[j], 7) for j in range(size)] if rank == root else None
                out: list[Any] = [None, "kept"]
                assert dist.scatter_object_list(out, parts, group=g, **how) is None
                return out

            got, want = both(pg, gloo, scatter, f"scatter_object_list {how}")
            agree(got, want, f"{where}: scatter_object_list {how}")
            agree(got, [obj(members[rank], 7), "kept"], f"{where}: scatter_object_list")

    if size > 1:
        check_point_to_point(size, rank, pg, gloo, members)
    check_errors(size, rank, pg, gloo, members)


def check_point_to_point(size: int, rank: int, pg: Any, gloo: Any, members: list[int]) -> None:
    """Group rank 0 sends each other rank a list and gets one back; returns are global ranks."""

    def exchange(g: Any) -> list[Any]:
        got: list[Any] = []
        for peer in range(1, size):
            by = {"dst": members[peer]} if peer % 2 else {"group_dst": peer}
            from_ = {"src": members[peer]} if peer % 2 else {"group_src": peer}
            if rank == 0:
                sent = dist.send_object_list([obj(members[peer], 9), peer], group=g, **by)
                assert sent is None
                box: list[Any] = [None, None, None]
                got += [dist.recv_object_list(box, group=g, **from_), box]
            elif rank == peer:
                box = [None, None]
                source = dist.recv_object_list(box, src=members[0], group=g, device="cpu")
                got += [source, box]
                dist.send_object_list([rank, obj(members[rank], 11), None], group_dst=0, group=g)
        return got

    got, want = both(pg, gloo, exchange, "send/recv_object_list")
    agree(got, want, f"global rank {members[rank]}: send/recv_object_list")
    if rank == 0:
        agree(got[0], members[1], "recv_object_list returns the sender's global rank")
    else:
        agree(got[0], members[0], "recv_object_list returns the sender's global rank")


def check_errors(size: int, rank: int, pg: Any, gloo: Any, members: list[int]) -> None:
    """Bad arguments raise what torch raises on gloo, before anything is sent."""
    outsider = next(r for r in range(dist.get_world_size() + 1) if r not in members)
    calls: list[Callable[[Any], Any]] = [
        lambda g: dist.gather_object(1, [None] * size, dst=members[0], group=g, group_dst=0),
        lambda g: dist.gather_object(1, None, group_dst=rank, group=g),
        lambda g: dist.scatter_object_list([], [1] * size, group_src=rank, group=g),
        lambda g: dist.scatter_object_list([None], None, group_src=rank, group=g),
        lambda g: dist.send_object_list([1], group=g),
        lambda g: dist.send_object_list([1], group_dst=rank, group=g),
        lambda g: dist.recv_object_list([1], group=g),
        lambda g: dist.recv_object_list([1], src=members[rank], group=g),
        lambda g: dist.broadcast_object_list([1], src=members[0], group_src=0, group=g),
    ]
    if pg is not dist.group.WORLD:  # on the default group a global rank is its group rank
        calls.append(lambda g: dist.broadcast_object_list([1], src=outsider, group=g))
    for k, call in enumerate(calls):
        on_plait, on_gloo = error(lambda c=call: c(pg)), error(lambda c=call: c(gloo))
        assert on_plait, f"error case {k}: nothing raised on plait"
        # messages may name the group (its repr differs): compare up to that
        assert on_plait.split(" group ")[0] == on_gloo.split(" group ")[0], (k, on_plait, on_gloo)


def check_order(size: int, rank: int) -> None:
    """send_object_list keeps its place after an isend on tag 0; collectives after async ones."""
    if rank in (0, 1):
        peer = 1 - rank
        if rank == 0:
            work = dist.isend(torch.full((4,), 7.0), dst=peer)
            dist.send_object_list(["after the isend"], dst=peer)
            work.wait()
        else:
            t = torch.zeros(4)
            dist.recv(t, src=peer)
            box: list[Any] = [None]
            assert dist.recv_object_list(box, src=peer) == peer
            assert t.tolist() == [7.0] * 4, t
            assert box == ["after the isend"], box
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    out: list[Any] = [None] * size
    dist.all_gather_object(out, rank)
    assert work.wait()
    assert out == list(range(size)), out
    assert t.tolist() == [float(size)] * 3, t
    assert isinstance(dist.group.WORLD, plait.torch.ProcessGroupPlait)
