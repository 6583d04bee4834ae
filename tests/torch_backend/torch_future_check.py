"""The ``futures`` mode of ``torch_rank_check.py``: what an async call's future holds.

Every collective is called with ``async_op=True`` the same way on the "plait"
default group and on a "gloo" group of the same job, and the value of
``work.get_future().wait()`` must be laid out as gloo's: the same nesting of
lists, and tensors of the same shapes, dtypes and values. ``work.result()`` of
a plait work must be that value too. Calls whose gloo work has no future
(``reduce_scatter``, point to point) are left out; so are the contents of a
reduce's tensor on ranks other than the root, which torch leaves undefined
(gloo's differ from the input).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

#: A call made with ``async_op=True`` on the group given: its work (or a future of it).
Call = Callable[[dist.ProcessGroup], Any]


def layout(value: Any, shapes_only: bool = False) -> Any:
    """``value`` with every tensor as (shape, dtype, values): lists and tuples as lists."""
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            str(value.dtype),
            None if shapes_only else value.tolist(),
        )
    if isinstance(value, (list, tuple)):
        return [layout(v, shapes_only) for v in value]
    return ("other", repr(value))


def calls(size: int, rank: int) -> Iterator[tuple[str, Call, bool]]:
    """(name, call, whether to compare values too) for every collective whose gloo work has a
    future; each call makes its tensors afresh, so both groups start from the same ones."""

    def t(*values: float) -> torch.Tensor:
        return torch.tensor([float(v) for v in values])

    def listed(n: float = 0.0) -> list[torch.Tensor]:
        return [t(n, n) for _ in range(size)]

    yield "all_reduce", lambda g: dist.all_reduce(t(rank, 1), group=g, async_op=True), True
    yield "broadcast", lambda g: dist.broadcast(t(rank), size - 1, group=g, async_op=True), True
    yield "reduce", lambda g: dist.reduce(t(rank), 0, group=g, async_op=True), rank == 0
    yield (
        "all_gather",
        lambda g: dist.all_gather(listed(), t(rank, 2), group=g, async_op=True),
        True,
    )
    yield (
        "all_gather_into_tensor",
        lambda g: dist.all_gather_into_tensor(
            torch.zeros(2 * size), t(rank, 3), group=g, async_op=True
        ),
        True,
    )
    yield (
        "gather",
        lambda g: dist.gather(
            t(rank, 4), listed() if rank == 0 else None, 0, group=g, async_op=True
        ),
        True,
    )
    yield (
        "scatter",
        lambda g: dist.scatter(
            t(0, 0),
            [t(r, 5) for r in range(size)] if rank == 0 else None,
            0,
            group=g,
            async_op=True,
        ),
        True,
    )
    yield (
        "all_to_all",
        lambda g: dist.all_to_all(
            listed(), [t(rank, r) for r in range(size)], group=g, async_op=True
        ),
        True,
    )
    yield (
        "all_to_all_single",
        lambda g: dist.all_to_all_single(
            torch.zeros(size), torch.arange(size) + 10.0 * rank, group=g, async_op=True
        ),
        True,
    )
    yield "barrier", lambda g: dist.barrier(group=g, async_op=True), True
    yield (
        "all_gather_coalesced",
        lambda g: dist.all_gather_coalesced(
            [[t(0), t(0, 0)] for _ in range(size)], [t(rank), t(rank, 6)], group=g, async_op=True
        ),
        True,
    )

    def coalesced_into_tensor(g: dist.ProcessGroup) -> Any:
        outs = [torch.zeros(size), torch.zeros(2 * size)]
        with dist._coalescing_manager(group=g, async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], t(rank), group=g)
            dist.all_gather_into_tensor(outs[1], t(rank, 7), group=g)
        assert len(cm.works) == 1, cm.works  # one coalesced call on either backend
        return cm.works[0]

    yield "all_gather_into_tensor in a coalescing block", coalesced_into_tensor, True


def check_futures(size: int, rank: int) -> None:
    """Each call's future value on plait is laid out as on gloo."""
    gloo = dist.new_group(backend="gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecated names
        for name, call, values in calls(size, rank):
            got = {}
            for which, group in (("plait", None), ("gloo", gloo)):
                work = call(group)  # all_gather_coalesced returns a future, not a work
                is_work = hasattr(work, "get_future")
                got[which] = (work.get_future() if is_work else work).wait()
                if which == "plait" and is_work:
                    assert layout(work.result()) == layout(got[which]), f"{name}: result()"
            plait_value, gloo_value = (layout(got[k], not values) for k in ("plait", "gloo"))
            if plait_value != gloo_value:
                raise AssertionError(
                    f"rank {rank}: {name}: the future holds {plait_value} on plait, "
                    f"{gloo_value} on gloo"
                )
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)
