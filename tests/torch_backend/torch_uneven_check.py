"""One rank of the uneven and object tests of the torch backend; run by ``plait run -n N``.

Modes (first argument, comma-separated; each rank prints ``rank R: <mode> passed``):
    uneven   all_to_all_single with split sizes (zeros included), all_to_all
             of lists, all_gather into a list of different sizes and
             reduce_scatter of one, sync and async, on the "plait" default
             group against a "gloo" group beside it where gloo serves the call
             (all_to_all_single, reduce_scatter) and against numpy; and the
             bytes a skewed all_to_all_single moves, from plait's counters
    objects  plait's object collectives reached through
             ``plait.torch.communicator()``, against torch's own ``*_object``
             functions on the gloo group; and the bytes torch's padded
             all_gather_object moves against plait's allgather_object

Lines ``rank R: bytes <case>: <key> <value> ...`` report byte counts for the test to read.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import plait
import plait.torch
from plait.torch import _objects

R = dist.ReduceOp
RANK = -1


def data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """``n`` small integers for rank ``rank`` (exact in every dtype)."""
    values = (np.arange(n) * 7 + rank * 13 + salt * 5) % 11 + 1
    return torch.from_numpy(values).to(dtype)


def same(got: torch.Tensor, want: np.ndarray | torch.Tensor, what: str) -> None:
    want_t = torch.as_tensor(np.asarray(want)).to(got.dtype).reshape(got.shape)
    if not torch.equal(got, want_t):
        raise AssertionError(f"rank {RANK}: {what}: got {got.tolist()}, expected {want_t.tolist()}")


def raised(kind: type[BaseException], call: Callable[[], Any], what: str) -> BaseException:
    """The ``kind`` error that ``call`` raises (AssertionError if it raises none)."""
    try:
        call()
    except kind as exc:
        return exc
    raise AssertionError(f"rank {RANK}: {what}: no {kind.__name__} raised")


def run(call: Callable[[], Any], async_op: bool, k: int) -> None:
    """Finish ``call``'s work: wait() on even ``k``, the future on odd ones (async only)."""
    work = call()
    if not async_op:
        assert work is None, work
    elif k % 2:
        work.get_future().wait()
        assert work.is_completed()
        assert work.is_success()
    else:
        assert work.wait() is True


# -- uneven collectives ---------------------------------------------------------------------
def splits(size: int, zero_rank: int | None) -> list[list[int]]:
    """m[i][j]: the rows rank i sends rank j; zeros inside, and none at all from ``zero_rank``."""
    return [[0 if i == zero_rank else (i + 2 * j) % 3 for j in range(size)] for i in range(size)]


def check_uneven(size: int, rank: int) -> None:
    gloo = dist.new_group(backend="gloo")
    k = 0
    for async_op in (False, True):
        for dtype in (torch.float32, torch.int64):
            for zero_rank in (None, 0, size - 1):
                check_all_to_all_single(size, rank, gloo, dtype, zero_rank, async_op, k)
                check_all_to_all(size, rank, dtype, zero_rank, async_op, k + 1)
                k += 2
            check_all_gather(size, rank, dtype, async_op, k)
            check_reduce_scatter(size, rank, gloo, dtype, async_op, k + 1)
            k += 2
    check_all_zero(size, rank)
    check_split_mismatch(size, rank)
    check_skewed_bytes(size, rank)
    dist.barrier(group=gloo)  # every rank is done with gloo before any destroys it
    dist.destroy_process_group(gloo)


def check_all_to_all_single(
    size: int,
    rank: int,
    gloo: dist.ProcessGroup,
    dtype: torch.dtype,
    zero_rank: int | None,
    async_op: bool,
    k: int,
) -> None:
    m = splits(size, zero_rank)
    send, recv = m[rank], [m[j][rank] for j in range(size)]
    inputs = [data(r, sum(m[r]) * 2, dtype, k).reshape(-1, 2) for r in range(size)]
    want = torch.cat(
        [inputs[j][sum(m[j][:rank]) : sum(m[j][: rank + 1])] for j in range(size)]
    ).reshape(-1, 2)
    got = torch.full((sum(recv), 2), -1, dtype=dtype)
    run(lambda: dist.all_to_all_single(got, inputs[rank], recv, send, async_op=async_op),
        async_op, k)  # fmt: skip
    on_gloo = torch.full_like(got, -2)
    dist.all_to_all_single(on_gloo, inputs[rank], recv, send, group=gloo)
    what = f"all_to_all_single {dtype} zero rank {zero_rank} async {async_op}"
    same(got, want, what)
    same(got, on_gloo, f"{what} (gloo)")
    # into a strided output: plait stages it and writes it back
    strided = torch.full((2, sum(recv)), -1, dtype=dtype).t()
    run(lambda: dist.all_to_all_single(strided, inputs[rank], recv, send, async_op=async_op),
        async_op, k + 1)  # fmt: skip
    same(strided, want, f"{what} strided output")


def check_all_to_all(
    size: int, rank: int, dtype: torch.dtype, zero_rank: int | None, async_op: bool, k: int
) -> None:
    """Lists of different sizes (gloo refuses them): against what each rank sent."""
    m = splits(size, zero_rank)
    ins = [data(rank * size + j, m[rank][j], dtype, k) for j in range(size)]
    outs = [torch.full((m[j][rank],), -1, dtype=dtype) for j in range(size)]
    run(lambda: dist.all_to_all(outs, ins, async_op=async_op), async_op, k)
    for j in range(size):
        what = f"all_to_all[{j}] {dtype} zero rank {zero_rank} async {async_op}"
        same(outs[j], data(j * size + rank, m[j][rank], dtype, k), what)


def check_all_gather(size: int, rank: int, dtype: torch.dtype, async_op: bool, k: int) -> None:
    """Rank r gives (2r) % 3 rows of 3 (rank 0 none), then tensors of different shapes."""
    rows = [(2 * r) % 3 for r in range(size)]
    every = [data(r, rows[r] * 3, dtype, k).reshape(rows[r], 3) for r in range(size)]
    outs = [torch.full((n, 3), -1, dtype=dtype) for n in rows]
    run(lambda: dist.all_gather(outs, every[rank], async_op=async_op), async_op, k)
    for r in range(size):
        same(outs[r], every[r], f"uneven all_gather[{r}] {dtype} async {async_op}")
    # any shapes: only the element counts matter (a strided output too)
    shaped = [data(r, (r + 1) * (r + 2), dtype, k + 1).reshape(r + 1, r + 2) for r in range(size)]
    outs2 = [torch.full((r + 2, r + 1), -1, dtype=dtype).t() for r in range(size)]
    run(lambda: dist.all_gather(outs2, shaped[rank], async_op=async_op), async_op, k + 1)
    for r in range(size):
        same(outs2[r], shaped[r], f"all_gather of shapes[{r}] {dtype} async {async_op}")


def check_reduce_scatter(
    size: int, rank: int, gloo: dist.ProcessGroup, dtype: torch.dtype, async_op: bool, k: int
) -> None:
    """input_list[j] has (3j) % 4 elements (rank 0 gets none): against gloo and numpy."""
    counts = [(3 * j) % 4 for j in range(size)]
    for op, fold in ((R.SUM, np.add), (R.MAX, np.maximum)):
        every = [
            [data(r * size + j, counts[j], dtype, k) for j in range(size)] for r in range(size)
        ]
        want = every[0][rank].numpy()
        for r in range(1, size):
            want = fold(want, every[r][rank].numpy())
        out = torch.full((counts[rank],), -1, dtype=dtype)
        run(lambda out=out, ins=every[rank], op=op: dist.reduce_scatter(
            out, ins, op=op, async_op=async_op), async_op, k)  # fmt: skip
        on_gloo = torch.full_like(out, -2)
        dist.reduce_scatter(on_gloo, every[rank], op=op, group=gloo)
        what = f"uneven reduce_scatter {op} {dtype} async {async_op}"
        same(out, want, what)
        same(out, on_gloo, f"{what} (gloo)")


def check_all_zero(size: int, rank: int) -> None:
    """Every split 0: nothing moves, the output stays empty (against numpy: nothing)."""
    got = torch.empty(0, 4)
    dist.all_to_all_single(got, torch.empty(0, 4), [0] * size, [0] * size)
    assert got.shape == (0, 4)
    work = dist.all_to_all_single(got, torch.empty(0, 4), [0] * size, [0] * size, async_op=True)
    assert work.wait() is True
    outs = [torch.empty(0) for _ in range(size)]
    dist.all_gather(outs, torch.empty(0))  # equal (empty) sizes: the even path
    assert all(o.numel() == 0 for o in outs)


def check_split_mismatch(size: int, rank: int) -> None:
    """Split sizes that disagree between ranks: the same ValueError on every rank, sync and
    async (from wait() and from the future), in torch's terms; the group stays usable."""
    out = torch.empty(size + 1)
    bad = [2] + [1] * (size - 1)  # every rank expects 2 rows from rank 0, which sends 1
    words = ("split sizes disagree", "output_split_sizes[j]", "input_split_sizes")
    for how in ("sync", "wait", "future"):

        def call(how: str = how) -> None:
            if how == "sync":
                dist.all_to_all_single(out, torch.ones(size), bad, [1] * size)
                return
            work = dist.all_to_all_single(out, torch.ones(size), bad, [1] * size, async_op=True)
            work.wait() if how == "wait" else work.get_future().wait()

        exc = raised(ValueError, call, f"mismatched split sizes ({how})")
        missing = [w for w in words if w not in str(exc)]
        assert not missing, f"rank {rank}: {how}: message lacks {missing}: {exc}"
        assert not isinstance(exc, plait.CommError), type(exc)
        assert isinstance(exc.__cause__, ValueError), exc.__cause__
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    same(t, np.full(3, sum(range(size))), "all_reduce after mismatched split sizes")


def check_skewed_bytes(size: int, rank: int) -> None:
    """A skewed all_to_all_single moves its payload and the count exchange, no padding.

    Rank 0 sends BIG rows to the last rank and every other pair one row; a
    padded alltoall would make every rank send BIG rows to every peer.
    """
    comm = plait.torch.communicator()
    big, width = 8192, 16  # rows of 16 float32: 512 KiB from rank 0 to the last rank
    row_bytes = width * 4
    send = [1] * size
    if rank == 0:
        send[size - 1] = big
    recv = [1] * size
    if rank == size - 1:
        recv[0] = big
    x = torch.ones(sum(send), width)
    out = torch.empty(sum(recv), width)
    # what the count exchange costs alone: the same allgather of 2·size int64 per rank
    before = comm.stats()
    comm.allgather(np.zeros(2 * size, np.int64))
    exchange = (comm.stats() - before).bytes_sent
    before = comm.stats()
    dist.all_to_all_single(out, x, recv, send)
    sent = (comm.stats() - before).bytes_sent
    payload = sum(n for j, n in enumerate(send) if j != rank) * row_bytes
    padded = (size - 1) * big * row_bytes  # a padded alltoall: BIG rows to every peer
    same(out, torch.ones(sum(recv), width), "skewed all_to_all_single")
    print(
        f"rank {rank}: bytes all_to_all_single skewed: sent {sent} payload {payload} "
        f"exchange {exchange} padded {padded}",
        flush=True,
    )
    assert sent == payload + exchange, (sent, payload, exchange)


# -- object collectives -----------------------------------------------------------------------
def obj(rank: int, salt: int = 0) -> dict[str, Any]:
    """An object of rank-dependent size: text, a numpy array and a tensor."""
    return {
        "rank": rank,
        "text": "x" * (rank * 100 + salt),
        "array": np.arange(rank * 3000 + salt, dtype=np.int64),
        "tensor": torch.arange(rank * 700 + salt, dtype=torch.float32),
    }


def equal(a: Any, b: Any) -> bool:
    """Equality through containers, numpy arrays and tensors."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


def agree(got: Any, want: Any, what: str) -> None:
    if not equal(got, want):
        raise AssertionError(f"rank {RANK}: {what}: got {got!r}, expected {want!r}")


def check_objects(size: int, rank: int) -> None:
    gloo = dist.new_group(backend="gloo")
    comm = plait.torch.communicator()
    assert comm is dist.group.WORLD.communicator
    assert (comm.rank, comm.size) == (rank, size)
    sub = dist.new_group(backend="plait")
    sub_comm = plait.torch.communicator(sub)
    assert sub_comm is sub.communicator
    assert sub_comm is not comm
    exc = raised(TypeError, lambda: plait.torch.communicator(gloo), "communicator(gloo group)")
    assert "'plait' backend" in str(exc), exc

    every = [obj(r) for r in range(size)]
    torch_list: list[Any] = [None] * size
    dist.all_gather_object(torch_list, every[rank], group=gloo)
    agree(comm.allgather_object(every[rank]), torch_list, "allgather_object vs gloo")
    agree(sub_comm.allgather_object(every[rank]), every, "allgather_object on a sub-group")

    for root in {0, size - 1}:
        gathered = [None] * size if rank == root else None
        dist.gather_object(every[rank], gathered, dst=root, group=gloo)
        agree(comm.gather_object(every[rank], root), gathered, f"gather_object root {root}")

        box = [obj(root, 5) if rank == root else None]
        dist.broadcast_object_list(box, src=root, group=gloo)
        mine = obj(root, 5) if rank == root else None
        agree(comm.bcast_object(mine, root), box[0], f"bcast_object root {root}")

        parts = [obj(j, 7) for j in range(size)]
        scattered: list[Any] = [None]
        dist.scatter_object_list(scattered, parts if rank == root else None, src=root, group=gloo)
        got = comm.scatter_object(parts if rank == root else None, root)
        agree(got, scattered[0], f"scatter_object root {root}")

    # point to point: rank 0 sends every other rank an object, each answers
    if rank == 0:
        for peer in range(1, size):
            dist.send_object_list([obj(peer, 9)], dst=peer, group=gloo)
            comm.send_object(obj(peer, 9), peer, tag=4)
        for peer in range(1, size):
            answer: list[Any] = [None]
            dist.recv_object_list(answer, src=peer, group=gloo)
            agree(comm.recv_object(peer, tag=4), answer[0], f"recv_object from {peer}")
    else:
        box = [None]
        dist.recv_object_list(box, src=0, group=gloo)
        agree(comm.recv_object(0, tag=4), box[0], "recv_object from 0")
        dist.send_object_list([obj(rank, 11)], dst=0, group=gloo)
        comm.send_object(obj(rank, 11), 0, tag=4)

    # torch has no all_to_all_object: against the obvious reference
    to = [(rank, j, np.full(rank + j, j)) for j in range(size)]
    want = [(j, rank, np.full(j + rank, rank)) for j in range(size)]
    agree(comm.alltoall_object(to), want, "alltoall_object")

    check_object_bytes(size, rank, comm)
    dist.destroy_process_group(sub)
    dist.barrier(group=gloo)
    dist.destroy_process_group(gloo)


def check_object_bytes(size: int, rank: int, comm: plait.Communicator) -> None:
    """Bytes of torch's own all_gather_object (on the plait group) and plait's, for skewed objects.

    ``dist.all_gather_object`` on a plait group is plait's allgather_object
    (plait.torch._objects); torch's own function is called here directly.
    """
    big = np.ones(256 * 1024, np.float32) if rank == 0 else np.ones(4, np.float32)  # 1 MiB
    before = comm.stats()
    on_torch: list[Any] = [None] * size
    _objects.original("all_gather_object")(on_torch, big)
    torch_sent = (comm.stats() - before).bytes_sent
    before = comm.stats()
    on_plait = comm.allgather_object(big)
    plait_sent = (comm.stats() - before).bytes_sent
    agree(on_plait, on_torch, "allgather_object vs torch's on plait")
    before = comm.stats()
    wrapped: list[Any] = [None] * size
    dist.all_gather_object(wrapped, big)
    assert (comm.stats() - before).bytes_sent == plait_sent, "dist.all_gather_object on plait"
    agree(wrapped, on_torch, "dist.all_gather_object vs torch's own")
    print(
        f"rank {rank}: bytes all_gather_object skewed: torch {torch_sent} plait {plait_sent}",
        flush=True,
    )


def main() -> None:
    global RANK
    dist.init_process_group("plait")
    size, rank = dist.get_world_size(), dist.get_rank()
    RANK = rank
    checks = {"uneven": check_uneven, "objects": check_objects}
    for name in sys.argv[1].split(","):
        checks[name](size, rank)
        dist.barrier()
        print(f"rank {rank}: {name} passed", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
