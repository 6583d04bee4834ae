"""DDP communication hooks: plait's gradient compressors inside DistributedDataParallel.

::

    import plait.torch
    from plait.compression import Int8, PowerSGD
    from plait.torch.hooks import compression_hook

    dist.init_process_group("plait")
    model = DistributedDataParallel(net)
    model.register_comm_hook(None, compression_hook(Int8()))

The hook averages each of DDP's gradient buckets with
``comm.allreduce(bucket, plait.AVG, compression=...)`` on the "plait" process
group (the default group, or the one passed as the hook's state), started
asynchronously so DDP's reducer overlaps it with the rest of backward. Stateful
compressors (top-k and PowerSGD with error feedback) keep their state per
bucket, keyed by the bucket's index and size (DDP rebuilds its buckets once,
after the first step; the residual of that first step is then dropped).
PowerSGD sees each bucket as one flat vector here (it falls back to the plain
allreduce for vectors); to compress layer by layer, call it per parameter in
your own loop. A bucket on a GPU is compressed and averaged on a host copy
and written back before the hook's future completes (Note [tensors on a GPU]
in ``plait.torch._staging``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import plait
from plait._compressed import check_compression
from plait.torch._convert import output_array
from plait.torch._group import plait_group
from plait.torch._staging import Staged, write_back
from plait.torch._work import PlaitWork

__all__ = ["compression_hook"]


def compression_hook(compressor: Any) -> Callable[[Any, Any], torch.futures.Future[Any]]:
    """A DDP communication hook that averages every bucket with ``compressor``.

    Args:
        compressor: a :class:`plait.compression.Compressor` (FP16, BF16, Int8,
            TopK, PowerSGD), one per model (its state is per bucket).

    Returns:
        ``hook(state, bucket) -> Future`` for ``DistributedDataParallel.register_comm_hook``;
        ``state`` is None (the default "plait" group) or a "plait" process group.

    Raises:
        TypeError: ``compressor`` is not a compressor (a class such as ``FP16``
            rather than ``FP16()``, say), here rather than at the first bucket.
    """
    check_compression(compressor, "compression_hook")

    def hook(state: Any, bucket: Any) -> torch.futures.Future[Any]:
        pg = plait_group(state, "compression_hook", ", or pass such a group as state")
        comm = pg.communicator
        buf = bucket.buffer()
        back: list[Staged] = []  # a bucket on a GPU, and its host copy
        a = output_array(buf, "compression_hook", "the bucket", back)
        # DDP rebuilds its buckets after the first step: the size is part of the key.
        keyed = compressor.with_key(f"ddp-bucket-{bucket.index()}-{a.size}")
        work = comm.allreduce(a, plait.AVG, compression=keyed, async_op=True)

        def finish() -> None:
            a[...] = work.wait()  # the compressed average lands in DDP's bucket
            write_back(back)  # from the host copy of a bucket on a GPU

        tracked = PlaitWork(
            pg._describe(f"DDP bucket {bucket.index()} allreduce (compressed)"),
            [work],
            [buf],
            finish=finish,
            notifier=pg._notifier,
            timeout=comm.timeout,
            global_ranks=pg._globals,
        )
        return tracked.get_future().then(lambda fut: fut.value()[0])

    # DDP checks the hook's annotations themselves (not their text, as this module writes them).
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook
