"""One rank of the torch backend tests; run by ``plait run -n N`` (or torchrun).

Modes (first argument):
    calls   every torch.distributed call on the "plait" backend against a numpy
            reference, float32/float64/int64, sync and async; non-contiguous
            tensors; object collectives, coalesced all_reduce, bfloat16
    errors  calls plait cannot serve, refused clearly; a failed call's work
            raising plait's error
    ddp     the same DDP training loop on "plait" and on "gloo" (same job, a
            gloo group beside the plait default group): parameters must agree
    basic   a few calls and a sub-group (for other ways of starting a job:
            torchrun, init_method=file://)
    suite   what torch's own distributed tests need beyond those: the group as
            the CPU device's backend, coalesced calls and coalescing blocks (with
            tensors of several dtypes), a tag per message, timeouts worded as
            torch's, sparse all_reduce, monitored_barrier
    objects torch's *_object functions on plait's object collectives, against
            gloo (the checks are in torch_object_check.py)
    futures what the future of every async collective holds, against gloo (the
            checks are in torch_future_check.py)
    resize  tensors stay resizable after every kind of call, and FSDP's sharded
            strategies train as on gloo (the checks are in torch_resize_check.py)
    staging tensors torch sees as CUDA tensors (fake_cuda.py: CPU memory, copies
            into them land on torch.cuda.synchronize) through dist.*: the
            results land in them, written back and synchronised

Modes combine with commas (``ddp,calls,errors``: one job, one torch import).
Each rank prints ``rank R: <mode> passed`` after each; any failed check raises,
so the launcher exits non-zero. The second argument says how to initialize:
``env`` (default) or an ``init_method`` URL such as ``file:///tmp/x``.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from fake_cuda import FakeCuda, FakeCudaTensor
from torch.nn.parallel import DistributedDataParallel
from torch_future_check import check_futures
from torch_object_check import check_objects
from torch_resize_check import check_resizable

import plait
import plait.torch

R = dist.ReduceOp
DTYPES = (torch.float32, torch.float64, torch.int64)
FLOAT_OPS = (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG)
INT_OPS = (R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)
NUMPY_OPS = {
    R.SUM: np.add,
    R.PRODUCT: np.multiply,
    R.MIN: np.minimum,
    R.MAX: np.maximum,
    R.BAND: np.bitwise_and,
    R.BOR: np.bitwise_or,
    R.BXOR: np.bitwise_xor,
}


def data(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (exact in every dtype, products stay small)."""
    n = int(np.prod(shape))
    values = (np.arange(n) * 7 + rank * 13 + salt * 5) % 5 + 1 + (np.arange(n) % 3 == rank % 3)
    return torch.from_numpy(values.reshape(shape)).to(dtype)


def reference(op: object, arrays: list[np.ndarray]) -> np.ndarray:
    """The reduction plait should produce, in rank order."""
    if op == R.AVG:
        return np.add.reduce(np.stack(arrays), axis=0) / len(arrays)
    out = arrays[0].copy()
    for a in arrays[1:]:
        out = NUMPY_OPS[op](out, a)
    return out


def same(got: torch.Tensor, want: np.ndarray | torch.Tensor, what: str) -> None:
    want_t = torch.as_tensor(np.asarray(want)).to(got.dtype).reshape(got.shape)
    if got.dtype.is_floating_point:
        ok = torch.allclose(got, want_t, rtol=1e-6, atol=0)
    else:
        ok = torch.equal(got, want_t)
    if not ok:
        raise AssertionError(f"rank {RANK}: {what}: got {got.tolist()}, expected {want_t.tolist()}")


def finish(works: list[tuple[dist.Work, object]]) -> None:
    """Wait on async works (every other one through its future) and run their checks."""
    for i, (work, check) in enumerate(works):
        if i % 2:
            work.get_future().wait()
            assert work.is_completed()
        else:
            assert work.wait() is True
        check()  # type: ignore[operator]
    works.clear()


# -- every call against numpy --------------------------------------------------------------
def check_calls(size: int, rank: int) -> None:
    for async_op in (False, True):
        for dtype in DTYPES:
            check_reductions(size, rank, dtype, async_op)
            check_movement(size, rank, dtype, async_op)
            check_point_to_point(size, rank, dtype, async_op)
    check_strided(size, rank)
    check_objects_and_coalesced(size, rank)
    check_mixed(size, rank)


def check_mixed(size: int, rank: int) -> None:
    """Blocking calls made while async ones are in flight, waited on in any order."""
    a = torch.ones(100_000)
    b = torch.full((10,), 2.0)
    c = torch.full((7,), float(rank))
    wa = dist.all_reduce(a, async_op=True)
    dist.all_reduce(b)  # blocking, on this thread, while `a` may still run on plait's worker
    wc = dist.all_reduce(c, op=R.MAX, async_op=True)
    assert wc.wait()
    assert wa.wait()
    same(a, np.full(100_000, float(size)), "async all_reduce before a blocking one")
    same(b, np.full(10, 2.0 * size), "blocking all_reduce between async ones")
    same(c, np.full(7, float(size - 1)), "async all_reduce after a blocking one")
    # A callback that makes a call and waits for its future, as torch's PowerSGD hook does:
    # it ran on the thread that completes the futures, and waited for it for ever.
    d = torch.ones(4)

    def chained(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return dist.all_reduce(d, async_op=True).get_future().wait()[0] + fut.wait()[0]

    e = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(chained).wait()
    same(e, np.full(4, 2.0 * size), "a callback that waits for a call's future")


def check_reductions(size: int, rank: int, dtype: torch.dtype, async_op: bool) -> None:
    works: list[tuple[dist.Work, object]] = []
    shape = (3, 5)
    ops = FLOAT_OPS if dtype.is_floating_point else INT_OPS
    for k, op in enumerate(ops):
        mine = data(rank, shape, dtype, k)
        every = [data(r, shape, dtype, k).numpy() for r in range(size)]
        want = reference(op, every)
        t = mine.clone()
        w = dist.all_reduce(t, op=op, async_op=async_op)
        works.append((w, lambda t=t, want=want, op=op: same(t, want, f"all_reduce {op} {dtype}")))

        root = (k + 1) % size
        t2 = mine.clone()
        w = dist.reduce(t2, dst=root, op=op, async_op=async_op)

        def check_reduce(t2=t2, want=want, root=root, mine=mine, op=op) -> None:
            expect = want if rank == root else mine
            same(t2, expect, f"reduce {op} root {root} {dtype}")

        works.append((w, check_reduce))

    # reduce_scatter_tensor: chunk r of the reduction of every rank's input
    for op in (R.SUM, R.MAX):
        big = [data(r, (size * 4, 2), dtype, 9).numpy() for r in range(size)]
        want = reference(op, big)[rank * 4 : (rank + 1) * 4]
        out = torch.empty(4, 2, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            w = dist.reduce_scatter_tensor(
                out, torch.from_numpy(big[rank]), op=op, async_op=async_op
            )
        works.append(
            (w, lambda out=out, want=want: same(out, want, f"reduce_scatter_tensor {dtype}"))
        )
        # the list form
        out2 = torch.empty(4, 2, dtype=dtype)
        inputs = list(torch.from_numpy(big[rank]).chunk(size))
        w = dist.reduce_scatter(out2, inputs, op=op, async_op=async_op)
        works.append((w, lambda out2=out2, want=want: same(out2, want, f"reduce_scatter {dtype}")))
    if async_op:
        finish(works)
    else:
        for _, check in works:
            check()  # type: ignore[operator]


def check_movement(size: int, rank: int, dtype: torch.dtype, async_op: bool) -> None:
    works: list[tuple[dist.Work | None, object]] = []
    every = [data(r, (2, 3), dtype, 4) for r in range(size)]
    mine = every[rank]

    root = size - 1
    t = mine.clone()
    w = dist.broadcast(t, src=root, async_op=async_op)
    works.append((w, lambda: same(t, every[root], f"broadcast {dtype}")))

    outs = [torch.empty(2, 3, dtype=dtype) for _ in range(size)]
    w = dist.all_gather(outs, mine, async_op=async_op)

    def check_all_gather() -> None:
        for r in range(size):
            same(outs[r], every[r], f"all_gather[{r}] {dtype}")

    works.append((w, check_all_gather))

    flat = torch.empty(size * 2, 3, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        w = dist.all_gather_into_tensor(flat, mine, async_op=async_op)
    works.append((w, lambda: same(flat, torch.cat(every), f"all_gather_into_tensor {dtype}")))

    # all_to_all_single, equal blocks: block j of rank r goes to rank j
    blocks = [data(r, (size * 2, 3), dtype, 6) for r in range(size)]
    got = torch.empty(size * 2, 3, dtype=dtype)
    w = dist.all_to_all_single(got, blocks[rank], async_op=async_op)
    want_even = torch.cat([blocks[r][rank * 2 : rank * 2 + 2] for r in range(size)])
    works.append((w, lambda: same(got, want_even, f"all_to_all_single {dtype}")))

    # all_to_all_single, uneven: rank r sends (r + j) % 3 + 1 rows to rank j
    def rows(src: int, dst: int) -> int:
        return (src + dst) % 3 + (src == dst)

    send_splits = [rows(rank, j) for j in range(size)]
    recv_splits = [rows(j, rank) for j in range(size)]
    inputs = [data(r, (sum(rows(r, j) for j in range(size)), 2), dtype, 8) for r in range(size)]
    got_uneven = torch.full((sum(recv_splits), 2), -1, dtype=dtype)
    w = dist.all_to_all_single(
        got_uneven, inputs[rank], recv_splits, send_splits, async_op=async_op
    )

    def check_uneven() -> None:
        parts = []
        for r in range(size):
            start = sum(rows(r, j) for j in range(rank))
            parts.append(inputs[r][start : start + rows(r, rank)])
        same(got_uneven, torch.cat(parts), f"all_to_all_single uneven {dtype}")

    works.append((w, check_uneven))

    # all_to_all on lists of different sizes
    in_list = [data(rank, (rank + j + 1,), dtype, 2) for j in range(size)]
    out_list = [torch.empty(j + rank + 1, dtype=dtype) for j in range(size)]
    w = dist.all_to_all(out_list, in_list, async_op=async_op)

    def check_all_to_all() -> None:
        for j in range(size):
            same(out_list[j], data(j, (j + rank + 1,), dtype, 2), f"all_to_all[{j}] {dtype}")

    works.append((w, check_all_to_all))

    for root in {0, size - 1}:
        gathered = [torch.empty(2, 3, dtype=dtype) for _ in range(size)] if rank == root else None
        w = dist.gather(mine, gathered, dst=root, async_op=async_op)

        def check_gather(gathered=gathered, root=root) -> None:
            if gathered is not None:
                for r in range(size):
                    same(gathered[r], every[r], f"gather root {root}[{r}] {dtype}")

        works.append((w, check_gather))

        parts = [data(j, (2, 3), dtype, 11 + root) for j in range(size)]
        got_part = torch.empty(2, 3, dtype=dtype)
        w = dist.scatter(got_part, parts if rank == root else None, src=root, async_op=async_op)
        works.append(
            (
                w,
                lambda got_part=got_part, parts=parts: same(
                    got_part, parts[rank], f"scatter {dtype}"
                ),
            )
        )

    works.append((dist.barrier(async_op=async_op), lambda: None))
    if async_op:
        finish(works)  # type: ignore[arg-type]
    else:
        for w, check in works:
            assert w is None
            check()  # type: ignore[operator]


def check_point_to_point(size: int, rank: int, dtype: torch.dtype, async_op: bool) -> None:
    """A ring: each rank sends to the next and receives from the previous (two tags)."""
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    mine = data(rank, (6,), dtype, 3)
    other = data(rank, (2, 2), dtype, 5)
    got = torch.empty(6, dtype=dtype)
    got_other = torch.empty(2, 2, dtype=dtype)
    if async_op:
        works = [
            dist.irecv(got, src=prv, tag=1),
            dist.irecv(got_other, src=prv, tag=2),
            dist.isend(other, dst=nxt, tag=2),  # the other tag first: tags are independent
            dist.isend(mine, dst=nxt, tag=1),
        ]
        for w in works:
            w.wait()
        assert works[0]._source_rank() == prv
    elif rank % 2 == 0:
        dist.send(mine, dst=nxt, tag=1)
        dist.send(other, dst=nxt, tag=2)
        assert dist.recv(got, src=prv, tag=1) == prv
        dist.recv(got_other, src=prv, tag=2)
    else:
        dist.recv(got, src=prv, tag=1)
        dist.recv(got_other, src=prv, tag=2)
        dist.send(mine, dst=nxt, tag=1)
        dist.send(other, dst=nxt, tag=2)
    same(got, data(prv, (6,), dtype, 3), f"send/recv {dtype}")
    same(got_other, data(prv, (2, 2), dtype, 5), f"send/recv tag 2 {dtype}")
    if async_op:
        got_batch = torch.empty(6, dtype=dtype)
        ops = [
            dist.P2POp(dist.isend, mine, nxt, tag=3),
            dist.P2POp(dist.irecv, got_batch, prv, tag=3),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same(got_batch, data(prv, (6,), dtype, 3), f"batch_isend_irecv {dtype}")


def check_strided(size: int, rank: int) -> None:
    """Non-contiguous inputs and outputs work (staged through contiguous copies)."""
    base = data(rank, (4, 6), torch.float64, 1)
    every = [data(r, (4, 6), torch.float64, 1).numpy() for r in range(size)]
    t = base.clone()
    view = t[:, ::2]  # strided
    dist.all_reduce(view)
    want = base.clone()
    want[:, ::2] = torch.from_numpy(reference(R.SUM, [a[:, ::2] for a in every]))
    same(t, want, "all_reduce on a strided view (and the rest untouched)")

    tt = base.clone().t()  # transposed: not contiguous
    dist.broadcast(tt, src=0)
    same(tt, torch.from_numpy(every[0]).t(), "broadcast into a transposed tensor")

    outs = [torch.empty(6, 4, dtype=torch.float64).t() for _ in range(size)]
    dist.all_gather(outs, base.t().contiguous().t())
    for r in range(size):
        same(outs[r], every[r], f"all_gather into transposed outputs [{r}]")

    x = base[:, 0]  # a column: strided input
    flat_t = torch.empty(4, size, dtype=torch.float64).t()  # a strided (size, 4) output
    got = torch.empty(size, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_gather_into_tensor(got, x)
        dist.all_gather_into_tensor(flat_t, x)
    for r in range(size):
        same(got[r], every[r][:, 0], f"all_gather_into_tensor row {r}")
    same(flat_t, got, "all_gather_into_tensor into a transposed view")


def check_objects_and_coalesced(size: int, rank: int) -> None:
    objs: list[object] = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"})
    assert objs == [{"rank": r, "name": f"r{r}"} for r in range(size)], objs
    box = [f"from rank 0 of {size}" if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box == [f"from rank 0 of {size}"], box

    a = data(rank, (3,), torch.float32, 1)
    b = data(rank, (2, 2), torch.float32, 2)
    want_a = reference(R.SUM, [data(r, (3,), torch.float32, 1).numpy() for r in range(size)])
    want_b = reference(R.SUM, [data(r, (2, 2), torch.float32, 2).numpy() for r in range(size)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.all_reduce_coalesced([a, b])
    same(a, want_a, "all_reduce_coalesced a")
    same(b, want_b, "all_reduce_coalesced b")

    h = data(rank, (5,), torch.bfloat16, 1)
    want_h = reference(R.SUM, [data(r, (5,), torch.float32, 1).numpy() for r in range(size)])
    dist.all_reduce(h)
    same(h.float(), want_h, "all_reduce bfloat16")


# -- errors ----------------------------------------------------------------------------------
def expect(kind: type[BaseException], words: tuple[str, ...], fn: object) -> BaseException:
    try:
        fn()  # type: ignore[operator]
    except kind as exc:
        text = str(exc)
        missing = [w for w in words if w not in text]
        if missing:
            raise AssertionError(f"rank {RANK}: message lacks {missing}: {text}") from exc
        return exc
    raise AssertionError(f"rank {RANK}: expected {kind.__name__} ({words})")


def check_errors(size: int, rank: int) -> None:
    """Calls plait cannot serve are refused with a clear error; a failing call's work raises."""
    t = torch.ones(4)
    premul = torch._C._distributed_c10d._make_nccl_premul_sum(2.0)
    expect(plait.UnsupportedError, ("PREMUL_SUM",), lambda: dist.all_reduce(t, op=premul))
    meta = torch.empty(4, device="meta")  # no data: nothing to stage
    expect(plait.UnsupportedError, ("meta", "no data"), lambda: dist.all_reduce(meta))
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,), check_invariants=True)
    expect(plait.UnsupportedError, ("sparse", "to_dense"), lambda: dist.broadcast(sparse, 0))
    ints = torch.ones(3, dtype=torch.int64)
    expect(TypeError, ("AVG", "int64"), lambda: dist.all_reduce(ints, op=R.AVG))
    expand = torch.zeros(1).expand(4)
    expect(plait.UnsupportedError, ("overlapping",), lambda: dist.all_reduce(expand))
    # Refused on every rank, the root's (which only reads it) too: it was refused where it
    # is written and sent elsewhere, and the group broke (MismatchError, then unusable).
    expect(plait.UnsupportedError, ("overlapping",), lambda: dist.broadcast(expand, 0))
    expect(plait.UnsupportedError, ("overlapping",), lambda: dist.reduce(expand, 0))
    expect(ValueError, ("tensor_list",), lambda: dist.all_gather([torch.empty(4)], t))
    # split sizes that disagree between ranks: every rank sees it and raises
    out = torch.empty(size + 1)
    splits_out = [1] * size
    splits_out[0] += 1  # every rank expects 2 rows from rank 0, which sends 1
    expect(
        ValueError,
        ("split sizes disagree", "output_split_sizes[j]", "input_split_sizes"),
        lambda: dist.all_to_all_single(out, torch.ones(size), splits_out, [1] * size),
    )
    # and the group still works after all of these
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    same(t, np.full(3, sum(range(size))), "all_reduce after the refused calls")
    check_failed_work(size, rank)


def check_failed_work(size: int, rank: int) -> None:
    """A call that fails in plait: its work raises plait's error, from wait() and the future."""
    sub = dist.new_group(backend="plait")
    if rank == 0:
        # the other ranks never join; the call's own timeout ends it
        work = dist.barrier(group=sub, async_op=True, timeout=timedelta(seconds=1))
        exc = expect(plait.CommTimeout, ("barrier",), work.wait)
        assert isinstance(exc, plait.CollectiveTimeout), type(exc)
        assert work.is_completed()
        assert not work.is_success()
        assert isinstance(work.exception(), plait.CommTimeout)
        expect(plait.CommTimeout, ("barrier",), lambda: work.get_future().wait())
        expect(plait.CommError, ("unusable",), lambda: dist.all_reduce(torch.ones(1), group=sub))
    dist.barrier()  # the default group is unaffected
    dist.destroy_process_group(sub)


# -- DDP ------------------------------------------------------------------------------------
def train(
    group: dist.ProcessGroup,
    rank: int,
    steps: int = 30,
    dtype: torch.dtype = torch.float64,
    hook: object = None,
) -> list[torch.Tensor]:
    """A small MLP trained data-parallel by DDP (gradients averaged); each rank its own batches."""
    torch.manual_seed(100 + rank)  # different initial weights: DDP's broadcast aligns them
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    ).to(dtype)
    # A tiny bucket cap: several buckets, so several allreduces in flight per step.
    ddp = DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.002)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(7 + rank)
    true_w = torch.linspace(-1, 1, 24, dtype=dtype).reshape(8, 3)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen, dtype=dtype)
        y = torch.tanh(x @ true_w) + 0.05 * torch.randn(32, 3, generator=gen, dtype=dtype)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_ddp(size: int, rank: int) -> None:
    """The issue's key test: DDP on "plait" and on "gloo" ends with the same parameters.

    float64, compared with rtol 1e-6: the backends may add the gradients of three
    or more ranks in different orders, and in float32 that last-bit difference,
    carried through 30 momentum steps, reaches ~1e-5 on small weights; in float64
    it stays far below 1e-6, while any real difference (a bucket missed, a wrong
    average, a broadcast skipped) shows at once. Two ranks add in one order
    only, so there float32 must agree bit for bit too.
    """
    gloo = dist.new_group(backend="gloo")
    on_plait = train(dist.group.WORLD, rank)
    on_gloo = train(gloo, rank)
    worst = max(
        float(((a - b).abs() / b.abs().clamp(min=1e-30)).max())
        for a, b in zip(on_plait, on_gloo, strict=True)
    )
    for a, b in zip(on_plait, on_gloo, strict=True):
        assert torch.allclose(a, b, rtol=1e-6), f"rank {rank}: plait and gloo DDP differ"
    if size == 2:
        f32 = zip(
            train(dist.group.WORLD, rank, dtype=torch.float32),
            train(gloo, rank, dtype=torch.float32),
            strict=True,
        )
        assert all(torch.equal(a, b) for a, b in f32), "float32 DDP differs on two ranks"
    # the replicas are identical on every rank
    flat = torch.cat([p.reshape(-1) for p in on_plait])
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat)
    assert all(torch.equal(every[0], e) for e in every), "replicas differ"
    print(f"rank {rank}: ddp plait vs gloo: largest relative difference {worst:.3g}", flush=True)
    dist.destroy_process_group(gloo)


def check_hooks(size: int, rank: int) -> None:
    """Compression as DDP communication hooks: close to the uncompressed run, replicas equal."""
    from plait.compression import FP16, Int8, TopK
    from plait.torch.hooks import compression_hook

    plain = train(dist.group.WORLD, rank, dtype=torch.float32)
    for name, compressor, tol in (("fp16", FP16(), 1e-2), ("int8", Int8(), 5e-2),
                                  ("topk", TopK(0.5), 0.5)):  # fmt: skip
        got = train(dist.group.WORLD, rank, dtype=torch.float32, hook=compression_hook(compressor))
        for a, b in zip(got, plain, strict=True):
            assert torch.allclose(a, b, rtol=tol, atol=tol), f"rank {rank}: {name} hook drifted"
        flat = torch.cat([p.reshape(-1) for p in got])
        every = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(every, flat)
        assert all(torch.equal(every[0], e) for e in every), f"{name}: replicas differ"
    gloo = dist.new_group(backend="gloo")
    expect(TypeError, ("plait",), lambda: compression_hook(FP16())(gloo, None))
    # Every rank has finished gloo's connection set-up before any closes its side (a rank that
    # destroyed the group early made its peer's connect fail with "closed by peer").
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)


def check_basic(size: int, rank: int) -> None:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    same(t, np.full(4, size * (size + 1) / 2), "all_reduce")
    w = dist.all_reduce(t, op=R.MAX, async_op=True)
    w.wait()
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(outs, torch.tensor([rank, 2 * rank]))
    assert [o.tolist() for o in outs] == [[r, 2 * r] for r in range(size)]
    sub = dist.new_group(backend="plait")
    u = torch.ones(2)
    dist.all_reduce(u, group=sub)
    same(u, np.full(2, float(size)), "all_reduce on a sub-group")
    dist.destroy_process_group(sub)


def check_suite(size: int, rank: int) -> None:
    check_any_source(size, rank)
    check_a_tag_per_message(size, rank)
    check_device_and_coalesced(size, rank)
    check_coalesced_dtypes(size, rank)
    check_sparse(size, rank)
    check_monitored_barrier(size, rank)
    check_timeout_wording(size, rank)


def check_any_source(size: int, rank: int) -> None:
    """``recv``/``irecv`` without ``src``: the sender's global rank, and MPI's matching order.

    On the default group rank 0 receives one message from every other rank
    (recv and irecv alternating), then, on tag 1, an any-source and a
    specific-source receive take rank 1's two messages in the order called.
    On a sub-group of the last two ranks (group ranks are not global ranks
    from 3 ranks on), ``dist.recv`` names the sender by its global rank.
    """
    if rank == 0:
        senders = []
        for i in range(size - 1):
            t = torch.full((5,), -1.0)
            if i % 2:
                work = dist.irecv(t)
                work.wait()
                sender = work._source_rank()
            else:
                sender = dist.recv(t)
            same(t, np.full(5, float(sender)), f"any-source receive from rank {sender}")
            senders.append(sender)
        assert sorted(senders) == list(range(1, size)), senders
        first, second = torch.zeros(2), torch.zeros(2)
        works = [dist.irecv(first, tag=1), dist.irecv(second, src=1, tag=1)]
        for w in works:
            w.wait()
        same(first, np.full(2, 10.0), "any-source receive called first gets the first message")
        same(second, np.full(2, 11.0), "then the specific-source one the second")
    else:
        dist.send(torch.full((5,), float(rank)), dst=0)
        if rank == 1:
            dist.send(torch.full((2,), 10.0), dst=0, tag=1)
            dist.send(torch.full((2,), 11.0), dst=0, tag=1)
    members = [size - 2, size - 1]
    sub = dist.new_group(members, backend="plait")
    if rank == members[0]:
        t = torch.zeros(3)
        assert dist.recv(t, group=sub) == members[1]
        same(t, np.full(3, 4.0), "any-source receive on a sub-group")
    elif rank == members[1]:
        dist.send(torch.full((3,), 4.0), dst=members[0], group=sub)
    dist.destroy_process_group(sub)


def check_a_tag_per_message(size: int, rank: int) -> None:
    """A ring of messages, each with a tag of its own, leaves no thread behind: every (peer,
    tag) kept a helper thread until the group was destroyed, 2 x 300 a rank here."""
    before = threading.active_count()
    got = torch.zeros(2)
    for step in range(300):
        recv = dist.irecv(got, src=(rank - 1) % size, tag=step)
        dist.send(torch.full((2,), float(step)), dst=(rank + 1) % size, tag=step)
        recv.wait()
        same(got, np.full(2, float(step)), f"message with tag {step}")
    grew = threading.active_count() - before
    assert grew <= 6, f"rank {rank}: {grew} more threads after 300 tags"


def check_device_and_coalesced(size: int, rank: int) -> None:
    """The group answers for the CPU and CUDA; coalesced calls, and coalescing blocks, work."""
    c10d = dist.distributed_c10d
    pg = dist.group.WORLD
    cpu = torch.device("cpu")
    assert c10d._device_capability(pg) == ["cpu", "cuda"]
    assert c10d._get_object_coll_device(pg) == "cpu"
    assert pg._get_backend(cpu) is pg
    assert pg._get_backend(torch.device("cuda")) is pg
    expect(RuntimeError, ("device type xpu",), lambda: pg._get_backend(torch.device("xpu")))
    ins = [torch.full((2, 2), float(rank)), torch.empty(0), torch.arange(3.0) + rank]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(size)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the call itself
        dist.all_gather_coalesced(outs, ins)
    for r in range(size):
        same(outs[r][0], np.full((2, 2), float(r)), f"all_gather_coalesced from rank {r}")
        same(outs[r][2], np.arange(3.0) + r, f"all_gather_coalesced from rank {r}")
    # a coalescing block with a device: its calls run, and the block's work waits for them all
    a, b = torch.full((3,), float(rank)), torch.full((2,), 1.0)
    gathered = torch.empty(2 * size)
    with c10d._coalescing_manager(device=cpu, async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    same(a, np.full(3, float(sum(range(size)))), "all_reduce in a coalescing block")
    same(b, np.full(2, float(size)), "all_reduce in a coalescing block")
    with c10d._coalescing_manager(device=cpu, async_ops=True) as cm:
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    cm.wait()
    same(gathered, np.repeat(np.arange(size, dtype=np.float64), 2), "all_gather in a block")
    pieces = torch.empty(2)
    work = pg.reduce_scatter_tensor_coalesced([pieces], [torch.arange(2.0 * size)])
    work.wait()
    same(pieces, np.arange(2.0 * rank, 2.0 * rank + 2) * size, "reduce_scatter_tensor_coalesced")
    assert pg._get_sequence_number_for_group() > 0


#: The dtypes of a coalesced call's tensors, mixed and interleaved (one collective per dtype).
MIXED = (torch.float32, torch.int64, torch.bfloat16, torch.float32, torch.int64)


def check_coalesced_dtypes(size: int, rank: int) -> None:
    """Coalesced all_gather_into_tensor and reduce_scatter_tensor with tensors of several dtypes,
    as torch's coalescing manager (blocking and async) and its functional collectives make
    them: each output as the call on its own would give it, where plait refused the call."""
    import torch.distributed._functional_collectives as funcol

    def gather_ins() -> list[torch.Tensor]:
        return [torch.full((j + 1,), float(rank * 10 + j), dtype=d) for j, d in enumerate(MIXED)]

    def gathered(j: int) -> np.ndarray:
        return np.repeat(np.arange(size) * 10.0 + j, j + 1)

    def scatter_ins() -> list[torch.Tensor]:
        return [(torch.arange(size * (j + 1)) + rank).to(d) for j, d in enumerate(MIXED)]

    def scattered(j: int) -> np.ndarray:
        n = j + 1
        return np.arange(rank * n, rank * n + n) * float(size) + sum(range(size))

    def same_all(got: list[torch.Tensor], want: Callable[[int], np.ndarray], what: str) -> None:
        for j, (t, d) in enumerate(zip(got, MIXED, strict=True)):
            assert t.dtype == d, f"{what} [{j}]: dtype {t.dtype}, expected {d}"
            same(t.float(), want(j), f"{what} [{j}]")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's deprecated names
        for async_ops in (False, True):
            ins = gather_ins()
            outs = [torch.empty(size * t.numel(), dtype=t.dtype) for t in ins]
            with dist.distributed_c10d._coalescing_manager(async_ops=async_ops) as cm:
                for o, i in zip(outs, ins, strict=True):
                    dist.all_gather_into_tensor(o, i)
            if async_ops:
                cm.wait()
            same_all(outs, gathered, f"all_gather_into_tensor coalesced (async {async_ops})")
            ins = scatter_ins()
            outs = [torch.empty(t.numel() // size, dtype=t.dtype) for t in ins]
            with dist.distributed_c10d._coalescing_manager(async_ops=async_ops) as cm:
                for o, i in zip(outs, ins, strict=True):
                    dist.reduce_scatter_tensor(o, i)
            if async_ops:
                cm.wait()
            same_all(outs, scattered, f"reduce_scatter_tensor coalesced (async {async_ops})")
        world = dist.group.WORLD
        got = funcol.all_gather_into_tensor_coalesced(gather_ins(), world)
        same_all([funcol.wait_tensor(t) for t in got], gathered, "funcol all_gather coalesced")
        got = funcol.reduce_scatter_tensor_coalesced(scatter_ins(), "sum", [0] * len(MIXED), world)
        same_all([funcol.wait_tensor(t) for t in got], scattered, "funcol reduce_scatter coalesced")


def check_sparse(size: int, rank: int) -> None:
    """Sparse COO all_reduce: the dense sum, coalesced, the same bits on every rank."""
    gen = torch.Generator().manual_seed(rank)
    for shape, sparse_dim in (((50,), 1), ((6, 7), 2), ((5, 3, 2), 1), ((4, 4), 1)):
        dense = torch.zeros(shape, dtype=torch.float32)
        mask = torch.rand(shape[:sparse_dim], generator=gen) < 0.3
        dense[mask] = torch.randn(shape, generator=gen)[mask]
        t = dense.to_sparse(sparse_dim)
        work = dist.all_reduce(t, async_op=rank % 2 == 1)
        if work is not None:
            work.wait()
        assert t.is_sparse
        assert t.is_coalesced()
        everyone = [torch.empty(shape) for _ in range(size)]
        dist.all_gather(everyone, dense)
        want = everyone[0].clone()
        for other in everyone[1:]:
            want += other
        assert torch.equal(t.to_dense(), want), f"rank {rank}: sparse all_reduce {shape}"
        results = [torch.empty(shape) for _ in range(size)]
        dist.all_gather(results, t.to_dense())
        assert all(torch.equal(r, results[0]) for r in results), "ranks disagree"
    s = torch.sparse_coo_tensor(
        torch.tensor([[rank]]), torch.tensor([2.0 * size]), (size,), check_invariants=True
    )
    dist.all_reduce(s, op=R.AVG)
    same(s.to_dense(), np.full(size, 2.0), "sparse all_reduce AVG")
    empty = torch.sparse_coo_tensor(
        torch.empty((1, 0), dtype=torch.int64), torch.empty(0), (4,), check_invariants=True
    )
    dist.all_reduce(empty)
    assert empty._nnz() == 0
    bad = torch.zeros(3 + rank).to_sparse()
    expect(ValueError, ("differ in the shape",), lambda: dist.all_reduce(bad))
    expect(plait.UnsupportedError, ("SUM",), lambda: dist.all_reduce(s, op=R.MAX))
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still usable
    same(t, np.full(2, float(size)), "all_reduce after a refused sparse call")


def check_monitored_barrier(size: int, rank: int) -> None:
    """plait.torch.monitored_barrier: passes when all come, names the rank that does not."""
    plait.torch.monitored_barrier(timeout=timedelta(seconds=30))
    last = size - 1
    if rank != last:
        exc = expect(
            plait.CommTimeout,
            (f"rank(s) [{last}] did not arrive",),
            lambda: plait.torch.monitored_barrier(timeout=timedelta(seconds=1)),
        )
        assert ("rank 0 reports" in str(exc)) == (rank != 0), exc
        dist.barrier()
    else:
        dist.barrier()  # after the others gave up: too late, and told so
        expect(plait.CommTimeout, (f"[{last}] did not arrive",), plait.torch.monitored_barrier)
    plait.torch.monitored_barrier(group=dist.group.WORLD)  # the group is still usable
    expect(
        ValueError,
        ("only implemented for GLOO",),
        lambda: dist.monitored_barrier(timeout=timedelta(seconds=1)),
    )


def check_timeout_wording(size: int, rank: int) -> None:
    """A timed-out call says "Timed out", as torch's backends do (its test suite looks for it)."""
    sub = dist.new_group(backend="plait", timeout=timedelta(seconds=1))
    if rank == 0:
        exc = expect(plait.CommTimeout, (" Timed out ", "barrier"), lambda: dist.barrier(sub))
        assert isinstance(exc, plait.CollectiveTimeout), type(exc)
    dist.barrier()
    dist.destroy_process_group(sub)


def check_staging(size: int, rank: int) -> None:
    """Tensors on (fake) CUDA through dist.*: results written back and synchronised."""
    cuda = FakeCuda(1)
    for name, fn in cuda.patches().items():  # torch.cuda.synchronize, for this rank's fake
        setattr(torch.cuda, name, fn)
    gpu = cuda.gpus[0]
    total = float(sum(range(size)))

    def landed(t: FakeCudaTensor, want: np.ndarray, what: str) -> None:
        held = t.held().numpy()
        assert np.array_equal(held, want), f"rank {rank}: {what}: {held} != {want}"

    t = gpu.tensor(np.full(3, float(rank), np.float32))
    dist.all_reduce(t)
    landed(t, np.full(3, total, np.float32), "all_reduce")
    t = gpu.tensor(np.full(3, float(rank), np.float32))
    work = dist.broadcast(t, src=size - 1, async_op=True)
    work.wait()
    landed(t, np.full(3, size - 1.0, np.float32), "broadcast, async")
    outs = [gpu.tensor(np.zeros(2, np.float32)) for _ in range(size)]
    dist.all_gather(outs, gpu.tensor(np.full(2, float(rank), np.float32)))
    for j, o in enumerate(outs):
        landed(o, np.full(2, float(j), np.float32), f"all_gather [{j}]")
    out = gpu.tensor(np.zeros(2, np.float32))
    dist.reduce_scatter_tensor(out, gpu.tensor(np.ones(2 * size, np.float32)))
    landed(out, np.full(2, float(size), np.float32), "reduce_scatter_tensor")
    got = gpu.tensor(np.zeros(size, np.float32))
    dist.all_to_all_single(got, gpu.tensor(np.arange(size, dtype=np.float32) + 10 * rank))
    landed(got, np.arange(size, dtype=np.float32) * 10 + rank, "all_to_all_single")
    peer = (rank + 1) % size
    buf = gpu.tensor(np.zeros(2, np.float32))
    recv = dist.irecv(buf, src=(rank - 1) % size)
    dist.send(gpu.tensor(np.full(2, 5.0 + rank, np.float32)), dst=peer)
    recv.wait()
    landed(buf, np.full(2, 5.0 + (rank - 1) % size, np.float32), "irecv")
    assert gpu.synced_writes[-1] == gpu.writes, "a write left unsynchronised"


def main() -> None:
    global RANK
    mode = sys.argv[1]
    how = sys.argv[2] if len(sys.argv) > 2 else "env"
    if how == "env":
        dist.init_process_group("plait")
    elif how.startswith("file://"):
        rank, size = int(os.environ["PLAIT_RANK"]), int(os.environ["PLAIT_SIZE"])
        dist.init_process_group("plait", init_method=how, rank=rank, world_size=size)
    else:
        raise SystemExit(f"unknown init {how!r}")
    size, rank = dist.get_world_size(), dist.get_rank()
    RANK = rank
    assert dist.get_backend() == "plait"
    assert isinstance(dist.group.WORLD, plait.torch.ProcessGroupPlait)
    checks = {
        "calls": check_calls,
        "errors": check_errors,
        "ddp": check_ddp,
        "basic": check_basic,
        "hooks": check_hooks,
        "suite": check_suite,
        "objects": check_objects,
        "staging": check_staging,
        "futures": check_futures,
        "resize": check_resizable,
    }
    for name in mode.split(","):
        checks[name](size, rank)
        dist.barrier()
        print(f"rank {rank}: {name} passed", flush=True)
    dist.destroy_process_group()


RANK = -1

if __name__ == "__main__":
    main()
