"""Data-parallel training with torch's DistributedDataParallel on the "plait" backend.

Run it with ``plait run -n 4 examples/train_torch_ddp.py`` (or ``torchrun
--nproc-per-node 4 examples/train_torch_ddp.py``). ``import plait.torch``
registers the backend; ``dist.init_process_group("plait")`` and DDP then work
as with gloo: DDP broadcasts rank 0's initial weights and averages gradients
with plait's allreduce, bucket by bucket, while backward runs. Each rank trains
on its own shard of a generated data set (three noisy spiral arms; nothing is
downloaded) and the script checks at the end that all replicas hold exactly
the same parameters.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import plait.torch  # noqa: F401 - registers the "plait" backend


def spirals(n: int, classes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points per class on ``classes`` noisy spiral arms in 2-D, shuffled."""
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, n)
        t = torch.linspace(c * 4.0, (c + 1) * 4.0, n) + 0.2 * torch.randn(n, generator=gen)
        xs.append(torch.stack([r * torch.sin(t), r * torch.cos(t)], dim=1))
        ys.append(torch.full((n,), c))
    x, y = torch.cat(xs), torch.cat(ys)
    order = torch.randperm(len(y), generator=gen)
    return x[order], y[order]


def main() -> None:
    """Train, report progress on rank 0, and check that the replicas agree."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    # Several ranks share this machine's cores: one compute thread each (torchrun does this too).
    local_size = int(os.environ.get("PLAIT_LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    dist.init_process_group("plait")
    rank, size = dist.get_rank(), dist.get_world_size()

    gen = torch.Generator().manual_seed(0)  # the same data and test split on every rank
    x, y = spirals(1500, 3, gen)
    x_train, y_train, x_test, y_test = x[:3600], y[:3600], x[3600:], y[3600:]
    x_mine, y_mine = x_train[rank::size], y_train[rank::size]  # this rank's shard

    torch.manual_seed(1 + rank)  # different initial weights: DDP starts everyone from rank 0's
    model = torch.nn.Sequential(
        torch.nn.Linear(2, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 3),
    )
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    batches = torch.Generator().manual_seed(100 + rank)

    start = time.perf_counter()
    steps = 0
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(y_mine), generator=batches)
        total = torch.zeros(2)  # summed loss, batches
        for i in range(0, len(order) - args.batch + 1, args.batch):
            idx = order[i : i + args.batch]
            loss = loss_fn(ddp(x_mine[idx]), y_mine[idx])
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients across ranks here
            opt.step()
            total += torch.tensor([loss.item(), 1.0])
            steps += 1
        dist.all_reduce(total)  # every rank's losses
        with torch.no_grad():
            acc = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
        if rank == 0:
            print(
                f"epoch {epoch}  loss {total[0] / total[1]:.4f}  test accuracy {acc:.3f}",
                flush=True,
            )
    elapsed = time.perf_counter() - start

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat)
    identical = all(torch.equal(every[0], other) for other in every)
    if rank == 0:
        print(
            f"done: {size} rank{'s' * (size != 1)}, {args.epochs} epochs "
            f"({steps} steps per rank) in {elapsed:.2f} s, test accuracy {acc:.3f}, "
            f"replicas identical: {identical}",
            flush=True,
        )
    dist.destroy_process_group()
    if not identical:
        raise SystemExit("replicas diverged")


if __name__ == "__main__":
    main()
