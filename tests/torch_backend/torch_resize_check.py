"""The ``resize`` mode of ``torch_rank_check.py``: tensors stay resizable after plait's calls.

A tensor that went through one call of the "plait" group could never be
resized again (plait read it with ``Tensor.numpy()``, which marks its storage
unresizable for good; a received object's tensor lay in memory torch did not
allocate), so FSDP's sharded strategies, which free a parameter's storage
with ``storage.resize_(0)`` after every all-gather, failed on their first
step. Here every kind of call leaves its tensors resizable, and FSDP (its
first version) trains with ``FULL_SHARD`` and ``SHARD_GRAD_OP`` on plait to
the same parameters as on a "gloo" group of the same job.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def resizable(t: torch.Tensor, what: str) -> None:
    """``t`` grows, and its storage is freed and allocated again (FSDP's way)."""
    n = t.numel()
    try:
        t.resize_(2 * n)
        storage = t.untyped_storage()
        storage.resize_(0)
        storage.resize_(2 * n * t.element_size())
    except RuntimeError as exc:  # "Trying to resize storage that is not resizable"
        raise AssertionError(f"rank {dist.get_rank()}: {what}: {exc}") from None


def check_calls(size: int, rank: int) -> None:
    """The tensors of collectives, point to point and object functions, sync and async."""
    x = torch.full((4,), float(rank))
    dist.all_reduce(x)
    resizable(x, "all_reduce")
    a = torch.ones(3)
    dist.all_reduce(a, async_op=True).wait()
    resizable(a, "async all_reduce")
    b = torch.full((2,), float(rank))
    dist.broadcast(b, src=0)
    resizable(b, "broadcast")
    piece, whole = torch.ones(2), torch.empty(2 * size)
    dist.all_gather_into_tensor(whole, piece)
    resizable(piece, "all_gather_into_tensor's input")
    resizable(whole, "all_gather_into_tensor's output")
    mine, rows = torch.empty(2), torch.ones(2 * size)
    dist.reduce_scatter_tensor(mine, rows)
    resizable(mine, "reduce_scatter_tensor's output")
    resizable(rows, "reduce_scatter_tensor's input")
    sent, got = torch.full((3,), float(rank)), torch.empty(3)
    recv = dist.irecv(got, src=(rank - 1) % size)
    dist.send(sent, dst=(rank + 1) % size)
    recv.wait()
    resizable(sent, "send")
    resizable(got, "irecv")
    big = torch.arange(300_000.0)  # over 1 MiB: a message of its own
    objs: list[object] = [{"big": big, "small": torch.ones(3)}] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    assert isinstance(objs[0], dict)
    resizable(objs[0]["big"], "broadcast_object_list's big tensor")
    resizable(objs[0]["small"], "broadcast_object_list's small tensor")
    every: list[object] = [None] * size
    dist.all_gather_object(every, torch.full((2000,), float(rank)))
    for r, t in enumerate(every):
        assert isinstance(t, torch.Tensor)
        resizable(t, f"all_gather_object's tensor of rank {r}")


def fsdp_train(group: dist.ProcessGroup, strategy: str, rank: int) -> list[torch.Tensor]:
    """Three steps of a small MLP under FSDP on ``group``; the rank's flat parameter shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    ).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP's notes on CPU use and deprecated strategies
        fsdp = FullyShardedDataParallel(
            model,
            process_group=group,
            device_id=torch.device("cpu"),
            sharding_strategy=getattr(ShardingStrategy, strategy),
        )
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3 + rank)
    for _ in range(3):
        x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
        loss = fsdp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in fsdp.parameters()]


def check_fsdp(size: int, rank: int) -> None:
    """FSDP's sharded strategies train on plait, to gloo's parameters."""
    gloo = dist.new_group(backend="gloo")
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        on_plait = fsdp_train(dist.group.WORLD, strategy, rank)
        on_gloo = fsdp_train(gloo, strategy, rank)
        for a, b in zip(on_plait, on_gloo, strict=True):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), (
                f"rank {rank}: FSDP {strategy} on plait and on gloo differ"
            )
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)


def check_resizable(size: int, rank: int) -> None:
    """Every call's tensors stay resizable; FSDP trains as on gloo."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecated names
        check_calls(size, rank)
    check_fsdp(size, rank)
