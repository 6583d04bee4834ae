"""Time DistributedDataParallel steps of a 3.2 M-parameter model on a torch backend.

Run it once per backend on the same ranks and compare the medians::

    plait run -n 2 python examples/ddp_step_time.py plait
    plait run -n 2 python examples/ddp_step_time.py gloo

Each rank runs one compute thread (the ranks share the machine's cores); rank 0
prints the median time of 40 steps after 5 of warm-up (docs/performance.md).
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import plait.torch  # noqa: F401 - registers the "plait" backend


def main() -> None:
    """Time the steps on the backend named by the first argument (default "plait")."""
    backend = sys.argv[1] if len(sys.argv) > 1 else "plait"
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    width = 1024
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, width), torch.randint(0, 10, (32,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        loss = loss_fn(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradient buckets here
        opt.step()

    for _ in range(5):
        step()
    dist.barrier()
    times = []
    for _ in range(40):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    times.sort()
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"{backend}: {params / 1e6:.2f} M parameters, median step {times[20] * 1e3:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
