"""CUDA tensors on the "plait" backend, staged through the host, tested without a GPU.

The tensors are ``fake_cuda.FakeCudaTensor``: CPU tensors that say they are on
``cuda:r``, that numpy cannot read, and whose ``copy_`` lands in their memory
only when ``torch.cuda.synchronize`` (patched for each test) runs. Each rank's
:class:`~plait.torch.ProcessGroupPlait` wraps a communicator of plait's
in-process transport, ranks are threads (``plait.testing.run_ranks``), and
rank r's tensors are on its own GPU, ``cuda:r``.

What is checked (Note [tensors on a GPU] in ``plait.torch._staging``): every
collective, coalesced call and point-to-point call, blocking and async, leaves
its results in the device memory of the very tensors passed (in place,
strided ones too) by the time the call returns, ``wait()`` returns,
``is_completed()`` says True or the future completes, which takes a write-back
and a synchronisation after it; inputs are copied at the call and never
written; a failed call writes nothing back; tensors that cannot be staged are
refused before anything is copied; ``init_process_group("plait")`` serves the
"cuda" device type. The real-process check is the "staging" mode of
``torch_rank_check.py`` (in ``test_torch_jobs.py``); checks on a real GPU remain
to be done.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)
import torch.distributed as dist  # noqa: E402 - after the skip
from fake_cuda import FakeCuda, FakeCudaTensor, FakeGpu  # noqa: E402

import plait  # noqa: E402
import plait.torch  # noqa: E402
from plait.compression import FP16  # noqa: E402
from plait.testing import memory_communicators, run_ranks  # noqa: E402
from plait.torch import ProcessGroupPlait  # noqa: E402
from plait.torch.hooks import compression_hook  # noqa: E402

pytestmark = pytest.mark.timeout(30)

C10D = torch._C._distributed_c10d
R = dist.ReduceOp
SIZE = 2


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """One fake GPU per rank, and ``torch.cuda.synchronize`` over them."""
    return FakeCuda(SIZE).install(monkeypatch)


def options(kind: str, asy: bool, **fields: Any) -> Any:
    """torch's options object ``kind`` (``"AllreduceOptions"``, ...) with ``asyncOp=asy``."""
    opts = getattr(C10D, kind)()
    opts.asyncOp = asy
    for name, value in fields.items():
        setattr(opts, name, value)
    return opts


def landed(t: FakeCudaTensor, want: Any, what: str) -> None:
    """``t``'s device memory holds ``want`` now."""
    expected = torch.as_tensor(np.asarray(want), dtype=t.dtype).reshape(t.shape)
    assert torch.equal(t.held(), expected), f"{what}: {t.held()} != {expected}"


def with_groups(cuda: FakeCuda, fn: Callable[[ProcessGroupPlait, FakeGpu], Any]) -> list[Any]:
    """``fn(group, gpu)`` on every rank (threads), each rank with its own fake GPU."""

    def body(comm: plait.Communicator) -> Any:
        pg = ProcessGroupPlait(comm)
        try:
            return fn(pg, cuda.gpus[comm.rank])
        finally:
            pg.shutdown()

    return run_ranks(SIZE, body, timeout=10.0, join_timeout=25.0)


def x(rank: int) -> np.ndarray:
    """Rank ``rank``'s input of the dense calls."""
    return np.arange(4, dtype=np.float32) + 10 * rank


# -- every call, blocking and async -------------------------------------------------------------
def collectives(pg: ProcessGroupPlait, gpu: FakeGpu, asy: bool) -> None:
    """Every collective of the group on fake CUDA tensors; results checked in device memory."""
    r, n = pg.rank(), pg.size()
    total = sum(x(j) for j in range(n))

    def done(work: Any) -> None:
        if asy:
            assert work.wait() is True
        assert work.is_completed()

    t = gpu.tensor(np.zeros(4, np.float32))
    t.launch(x(r))  # still being written by a kernel: .cpu() waits for it
    done(pg.allreduce([t], options("AllreduceOptions", asy)))
    landed(t, total, "all_reduce")

    t = FakeCudaTensor(torch.from_numpy(np.stack([x(r), x(r) + 1])).t(), gpu)  # strided
    done(pg.allreduce([t], options("AllreduceOptions", asy, reduceOp=R.MAX)))
    landed(t, np.stack([x(n - 1), x(n - 1) + 1]).T, "all_reduce of a strided tensor")

    t = gpu.tensor(x(r))
    done(pg.reduce([t], options("ReduceOptions", asy, rootRank=0, reduceOp=R.SUM)))
    landed(t, total if r == 0 else x(r), "reduce")
    assert t.writes == (1 if r == 0 else 0)  # only the root's tensor is written

    t = gpu.tensor(x(r))
    done(pg.broadcast([t], options("BroadcastOptions", asy, rootRank=1)))
    landed(t, x(1), "broadcast")
    assert t.writes == (0 if r == 1 else 1)  # the source's tensor is only read

    mine = gpu.tensor(x(r))
    outs = [gpu.tensor(np.zeros(4, np.float32)) for _ in range(n)]
    done(pg.allgather([outs], [mine], options("AllgatherOptions", asy)))
    for j, o in enumerate(outs):
        landed(o, x(j), f"all_gather [{j}]")
    assert mine.writes == 0

    mine = gpu.tensor(np.full(r + 1, r, np.float32))  # uneven: rank j has j + 1 elements
    outs = [gpu.tensor(np.zeros(j + 1, np.float32)) for j in range(n)]
    done(pg.allgather([outs], [mine], options("AllgatherOptions", asy)))
    for j, o in enumerate(outs):
        landed(o, np.full(j + 1, j), f"uneven all_gather [{j}]")

    out = gpu.tensor(np.zeros(4 * n, np.float32))
    done(pg.all_gather_single(out, gpu.tensor(x(r)), options("AllgatherOptions", asy)))
    landed(out, np.concatenate([x(j) for j in range(n)]), "all_gather_into_tensor")
    out = gpu.tensor(np.zeros(4 * n, np.float32))
    host_input = torch.from_numpy(x(r))  # a CPU input into a device output
    done(pg.all_gather_single(out, host_input, options("AllgatherOptions", asy)))
    landed(out, np.concatenate([x(j) for j in range(n)]), "all_gather_into_tensor (CPU input)")

    out = gpu.tensor(np.zeros(4, np.float32))
    ins = [gpu.tensor(x(r) + j) for j in range(n)]
    done(pg.reduce_scatter([out], [ins], options("ReduceScatterOptions", asy)))
    landed(out, total + n * r, "reduce_scatter")

    out = gpu.tensor(np.zeros(4, np.float32))
    whole = gpu.tensor(np.concatenate([x(r) + j for j in range(n)]))
    done(pg.reduce_scatter_single(out, whole, options("ReduceScatterOptions", asy)))
    landed(out, total + n * r, "reduce_scatter_tensor")
    assert whole.writes == 0

    out = gpu.tensor(np.zeros(2 * n, np.float32))
    src = gpu.tensor(np.arange(2 * n, dtype=np.float32) + 100 * r)
    done(pg.all_to_all_single(out, src, [], [], options("AllToAllOptions", asy)))
    want = np.concatenate([[100 * j + 2 * r, 100 * j + 2 * r + 1] for j in range(n)])
    landed(out, want, "all_to_all_single")

    sends = [j + 1 for j in range(n)]  # rank r sends j + 1 rows to rank j
    rows = [np.full((j + 1, 2), 100 * r + j, np.float32) for j in range(n)]
    src = gpu.tensor(np.concatenate(rows))
    out = gpu.tensor(np.zeros((n * (r + 1), 2), np.float32))
    done(pg.all_to_all_single(out, src, [r + 1] * n, sends, options("AllToAllOptions", asy)))
    landed(out, np.concatenate([np.full((r + 1, 2), 100 * j + r) for j in range(n)]), "uneven")

    ins = [gpu.tensor(np.full(j + 1, 10 * r + j, np.float32)) for j in range(n)]
    outs = [gpu.tensor(np.zeros(r + 1, np.float32)) for _ in range(n)]
    done(pg.alltoall(outs, ins, options("AllToAllOptions", asy)))
    for j, o in enumerate(outs):
        landed(o, np.full(r + 1, 10 * j + r), f"all_to_all [{j}]")

    mine = gpu.tensor(x(r))
    gathered = [[gpu.tensor(np.zeros(4, np.float32)) for _ in range(n)]] if r == 0 else []
    done(pg.gather(gathered, [mine], options("GatherOptions", asy, rootRank=0)))
    for j, o in enumerate(gathered[0] if gathered else []):
        landed(o, x(j), f"gather [{j}]")

    out = gpu.tensor(np.zeros(4, np.float32))
    parts = [[gpu.tensor(np.full(4, j + 0.5, np.float32)) for j in range(n)]] if r == 1 else []
    done(pg.scatter([out], parts, options("ScatterOptions", asy, rootRank=1)))
    landed(out, np.full(4, r + 0.5), "scatter")

    done(pg.barrier(options("BarrierOptions", asy)))


def coalesced(pg: ProcessGroupPlait, gpu: FakeGpu, asy: bool) -> None:
    """The coalesced calls and a coalescing block on the "cuda" device, on fake CUDA tensors."""
    r, n = pg.rank(), pg.size()
    tri = sum(range(n))

    def done(work: Any) -> None:
        if asy:
            work.wait()
        assert work.is_completed()

    a, b = gpu.tensor(np.full(3, r, np.float32)), gpu.tensor(np.full(2, r + 1, np.float32))
    done(pg.allreduce_coalesced([a, b], options("AllreduceCoalescedOptions", asy)))
    landed(a, np.full(3, tri), "all_reduce_coalesced [0]")
    landed(b, np.full(2, tri + n), "all_reduce_coalesced [1]")

    ins = [gpu.tensor(np.full(2, r, np.float32)), gpu.tensor(np.full(3, r + 10, np.float32))]
    lists = [[gpu.tensor(np.zeros(k, np.float32)) for k in (2, 3)] for _ in range(n)]
    done(pg.allgather_coalesced(lists, ins, options("AllgatherOptions", asy)))
    for j, (o0, o1) in enumerate(lists):
        landed(o0, np.full(2, j), f"all_gather_coalesced [{j}][0]")
        landed(o1, np.full(3, j + 10), f"all_gather_coalesced [{j}][1]")

    out = gpu.tensor(np.zeros(2 * n, np.float32))
    opts = options("AllgatherOptions", asy)
    done(pg.allgather_into_tensor_coalesced([out], [gpu.tensor(np.full(2, r, np.float32))], opts))
    landed(out, np.repeat(np.arange(n, dtype=np.float32), 2), "all_gather_into_tensor_coalesced")

    out = gpu.tensor(np.zeros(2, np.float32))
    whole = gpu.tensor(np.full(2 * n, r + 1, np.float32))
    opts = options("ReduceScatterOptions", asy)
    done(pg.reduce_scatter_tensor_coalesced([out], [whole], opts))
    landed(out, np.full(2, tri + n), "reduce_scatter_tensor_coalesced")

    device = torch.device("cuda", r)
    a, b = gpu.tensor(np.full(3, r, np.float32)), gpu.tensor(np.full(2, 1, np.float32))
    pg._start_coalescing(device)
    pg.allreduce([a], options("AllreduceOptions", True))
    pg.allreduce([b], options("AllreduceOptions", True))
    pg._end_coalescing(device).wait()
    landed(a, np.full(3, tri), "all_reduce in a coalescing block")
    landed(b, np.full(2, n), "all_reduce in a coalescing block")


@pytest.mark.parametrize("asy", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("calls", [collectives, coalesced], ids=["collectives", "coalesced"])
def test_results_land_in_the_device_tensors(
    cuda: FakeCuda, asy: bool, calls: Callable[[ProcessGroupPlait, FakeGpu, bool], None]
) -> None:
    with_groups(cuda, lambda pg, gpu: calls(pg, gpu, asy))
    for gpu in cuda.gpus:
        assert gpu.writes > 0
        assert gpu.synced_writes[-1] == gpu.writes  # no write left unsynchronised
        assert gpu.syncs <= gpu.writes  # one synchronisation per call, not one per tensor


def test_completion_means_written_back(cuda: FakeCuda) -> None:
    """is_completed(), the future and wait() each report a call done only once it is written."""

    def body(pg: ProcessGroupPlait, gpu: FakeGpu) -> None:
        r = pg.rank()
        a, b, c = (gpu.tensor(np.full(3, r + 1.0, np.float32)) for _ in range(3))
        works = [pg.allreduce([t], options("AllreduceOptions", True)) for t in (a, b, c)]
        for w in works:
            w._pending[0].wait()  # plait's own call is done: nothing written back yet
        assert (a.writes, b.writes, c.writes) == (0, 0, 0)
        assert works[0].is_completed()
        landed(a, np.full(3, 3.0), "after is_completed()")
        assert works[1].get_future().wait()[0] is b
        landed(b, np.full(3, 3.0), "after the future")
        assert works[2].wait() is True
        landed(c, np.full(3, 3.0), "after wait()")

    with_groups(cuda, body)


def test_compression_hook_on_a_device_bucket(cuda: FakeCuda) -> None:
    class Bucket:
        def __init__(self, buf: torch.Tensor) -> None:
            self._buf = buf

        def buffer(self) -> torch.Tensor:
            return self._buf

        def index(self) -> int:
            return 0

    def body(pg: ProcessGroupPlait, gpu: FakeGpu) -> None:
        buf = gpu.tensor(np.full(8, pg.rank() + 1.0, np.float32))
        got = compression_hook(FP16())(pg, Bucket(buf)).wait()
        assert got is buf
        landed(buf, np.full(8, 1.5), "compressed average")

    with_groups(cuda, body)


# -- point to point -------------------------------------------------------------------------------
@pytest.fixture
def pair(cuda: FakeCuda) -> Iterator[list[ProcessGroupPlait]]:
    pgs = [ProcessGroupPlait(c) for c in memory_communicators(SIZE, timeout=10.0)]
    try:
        yield pgs
    finally:
        for pg in pgs:
            pg.shutdown()


def test_point_to_point(cuda: FakeCuda, pair: list[ProcessGroupPlait]) -> None:
    """Sends copy their tensor at the call; receives write theirs back before completing."""
    g0, g1 = cuda.gpus
    src = g1.tensor(np.full(3, 1.0, np.float32))
    sent = pair[1].send([src], 0, 0)
    src.launch(np.full(3, 2.0, np.float32))  # changed after the call: not what is sent
    got = g0.tensor(np.zeros(3, np.float32))
    assert pair[0].recv([got], 1, 0).wait() is True
    sent.wait()
    landed(got, np.full(3, 1.0), "recv")
    anywhere = g0.tensor(np.zeros(3, np.float32))
    work = pair[0].recv_anysource([anywhere], 7)
    future = work.get_future()
    pair[1].send([g1.tensor(np.full(3, 5.0, np.float32))], 0, 7)
    assert future.wait()[0] is anywhere  # completed on the receive's helper thread
    landed(anywhere, np.full(3, 5.0), "recv from any source")
    assert work.source_rank() == 1
    assert g0.synced_writes[-1] == g0.writes == 2
    assert g1.writes == 0


# -- failures and refusals -------------------------------------------------------------------------
@pytest.mark.parametrize("asy", [False, True], ids=["blocking", "async"])
def test_a_failed_call_writes_nothing_back(cuda: FakeCuda, asy: bool) -> None:
    pgs = [ProcessGroupPlait(c) for c in memory_communicators(SIZE, timeout=5.0)]
    try:
        t = cuda.gpus[0].tensor(np.ones(3, np.float32))
        opts = options("AllreduceOptions", asy, timeout=timedelta(seconds=0.2))
        with pytest.raises(plait.CommTimeout, match="Timed out"):
            pgs[0].allreduce([t], opts).wait()  # rank 1 never calls
        late = cuda.gpus[0].tensor(np.zeros(3, np.float32))
        with pytest.raises(plait.CommError):
            pgs[0].recv([late], 1, 0).wait()  # the group failed with the allreduce
        assert cuda.gpus[0].writes == 0
        landed(t, np.ones(3), "after the failure")
    finally:
        for pg in pgs:
            pg.shutdown()


def test_a_timed_out_receive_writes_nothing_back(cuda: FakeCuda) -> None:
    pgs = [ProcessGroupPlait(c) for c in memory_communicators(SIZE, timeout=0.3)]
    try:
        t = cuda.gpus[0].tensor(np.full(3, -1.0, np.float32))
        with pytest.raises(plait.CommTimeout):
            pgs[0].recv([t], 1, 0).wait()
        assert cuda.gpus[0].writes == 0
        landed(t, np.full(3, -1.0), "after the timeout")
    finally:
        for pg in pgs:
            pg.shutdown()


def unstageable(gpu: FakeGpu) -> list[tuple[str, Callable[[ProcessGroupPlait], Any], str]]:
    """Calls with tensors the backend must refuse, and words the refusal must contain."""
    sparse = FakeCudaTensor(torch.sparse_coo_tensor([[0]], [1.0], (3,), check_invariants=True), gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch deprecates quantized tensors
        q = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    quantized = FakeCudaTensor(q, gpu)
    conj = FakeCudaTensor(torch.ones(2, dtype=torch.complex64).conj(), gpu)
    expanded = FakeCudaTensor(torch.zeros(1).expand(3), gpu)
    meta = torch.empty(3, device="meta")
    ok = gpu.tensor(np.zeros(3, np.float32))
    a = options("AllreduceOptions", False)
    b = options("BroadcastOptions", False)
    return [
        ("meta", lambda pg: pg.allreduce([meta], a), "meta, which has no data"),
        ("sparse all_reduce", lambda pg: pg.allreduce([sparse], a), "sparse tensors on the CPU"),
        ("sparse broadcast", lambda pg: pg.broadcast([sparse], b), "to_dense"),
        ("quantized", lambda pg: pg.broadcast([quantized], b), "dequantize"),
        ("conjugated", lambda pg: pg.broadcast([conj], b), "resolve_conj"),
        ("expanded output", lambda pg: pg.allreduce([expanded], a), "overlapping"),
        ("one of a list", lambda pg: pg.allreduce_coalesced([ok, sparse]), r"tensors\[1\]"),
    ]


def test_tensors_that_cannot_be_staged_are_refused_before_a_copy(
    cuda: FakeCuda, pair: list[ProcessGroupPlait]
) -> None:
    gpu = cuda.gpus[0]
    for name, call, words in unstageable(gpu):
        with pytest.raises(plait.UnsupportedError, match=words):
            call(pair[0])
        assert gpu.writes == 0, name
        if name != "one of a list":  # the tensors before the refused one were read
            assert gpu.reads == 0, name  # nothing copied to the host either
    expanded = FakeCudaTensor(torch.full((1,), 4.0).expand(3), gpu)  # an input is only read
    got = cuda.gpus[1].tensor(np.zeros(3, np.float32))
    recv = pair[1].recv([got], 0, 0)
    pair[0].send([expanded], 1, 0).wait()
    recv.wait()
    landed(got, np.full(3, 4.0), "an expanded input")
    # the group is still usable after the refusals
    ts = [g.tensor(np.ones(2, np.float32)) for g in cuda.gpus]
    opts = options("AllreduceOptions", True)
    works = [pg.allreduce([t], opts) for pg, t in zip(pair, ts, strict=True)]
    for w, t in zip(works, ts, strict=True):
        w.wait()
        landed(t, np.full(2, 2.0), "all_reduce after the refusals")


def test_numpy_cannot_read_the_fake() -> None:
    """The fake itself: numpy cannot read it, and copies into it land only on synchronize."""
    gpu = FakeGpu(0)
    t = gpu.tensor([1.0, 2.0])
    with pytest.raises(TypeError, match="cuda:0 device type tensor to numpy"):
        t.numpy()
    t.detach().copy_(torch.tensor([3.0, 4.0]))
    landed(t, [1.0, 2.0], "before synchronize")
    gpu.synchronize()
    landed(t, [3.0, 4.0], "after synchronize")
    assert (t.device.type, t.is_cpu, t.writes) == ("cuda", False, 1)


# -- registration and torch.distributed's own functions ----------------------------------------
def test_registered_for_cpu_and_cuda() -> None:
    assert dist.Backend.backend_capability["plait"] == ["cpu", "cuda"]
    [comm] = memory_communicators(1)
    pg = ProcessGroupPlait(comm)
    try:
        assert pg._device_types == [torch.device("cpu"), torch.device("cuda")]
        assert pg._get_backend(torch.device("cuda", 1)) is pg
        assert pg._get_backend("cpu") is pg
        with pytest.raises(RuntimeError, match="device type xpu"):
            pg._get_backend(torch.device("xpu"))
    finally:
        pg.shutdown()


def test_init_process_group_serves_cuda_tensors(cuda: FakeCuda) -> None:
    """dist.* on a one-rank "plait" default group, with tensors torch sees as CUDA tensors."""
    dist.init_process_group("plait", store=dist.HashStore(), rank=0, world_size=1)
    try:
        c10d = dist.distributed_c10d
        assert c10d._device_capability() == ["cpu", "cuda"]
        assert c10d._get_object_coll_device() == "cpu"  # objects stay on the host
        gpu = cuda.gpus[0]
        t = gpu.tensor(np.full(3, 2.0, np.float32))
        dist.all_reduce(t, op=R.PRODUCT)
        landed(t, np.full(3, 2.0), "dist.all_reduce")
        dist.broadcast(t, src=0)  # the source's tensor is only read
        out = gpu.tensor(np.zeros(3, np.float32))
        mine = gpu.tensor(np.arange(3, dtype=np.float32))
        work = dist.all_gather_single(out, mine, async_op=True)
        work.wait()
        landed(out, np.arange(3.0), "dist.all_gather_single")
        with c10d._coalescing_manager(device=torch.device("cuda", 0), async_ops=True) as cm:
            dist.all_reduce(t)
        cm.wait()
        landed(t, np.full(3, 2.0), "dist.all_reduce in a coalescing block")
        assert gpu.synced_writes[-1] == gpu.writes == 3
    finally:
        dist.destroy_process_group()
