"""The plait backend under PyTorch's own distributed test suite, and the pieces it needed.

In-process: sparse all-reduce's packing and summing (``plait.torch._sparse``),
the monitored barrier over a store, timeouts worded as torch's. Then a
representative part of torch's suite (``torch_dist_suite.py``, which runs all
of it; docs/torch.md) on two ranks: a handful of tests per family, run on
plait, and on plait standing in for gloo where a test names gloo.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)

import plait  # noqa: E402
from plait.rendezvous.store import MemoryStore  # noqa: E402
from plait.torch import _monitored, _sparse  # noqa: E402
from plait.torch._monitored import MonitoredBarrier  # noqa: E402
from plait.torch._work import timed_out  # noqa: E402

HERE = Path(__file__).resolve().parent
SUITE = HERE / "torch_dist_suite.py"

#: Tests of torch's suite run in CI: collectives, coalesced calls, point to point, groups,
#: DDP, and the ones that name gloo (run with plait standing in for gloo).
REPRESENTATIVE = (
    "test_all_reduce_sum_async",
    "test_all_gather_coalesced_with_empty",
    "test_all_gather_complex",
    "test_broadcast_full_group",
    "test_scatter_checks",
    "test_gather",
    "test_reduce_sum_twice",
    "test_send_recv_with_tag",
    "test_isend",
    "test_send_recv_any_source",
    "test_barrier_full_group",
    "test_destroy_group",
    "test_get_backend",
    "test_DistributedDataParallelCPU",
    "test_sparse_all_reduce_sum",
    "test_barrier_timeout_full_group",
    "test_all_reduce_coalesced_sum",
    "test_batch_isend_irecv_gloo_tags",
    "test_all_gather_object_subgroup",
    "test_get_future",
    "test_accumulate_gradients_no_sync",
)


# -- sparse all_reduce, one process ---------------------------------------------------------------
def ranks_tensors(size: int, shape: tuple[int, ...], sparse_dim: int, dtype: torch.dtype) -> list:
    tensors = []
    for rank in range(size):
        gen = torch.Generator().manual_seed(rank)
        dense = torch.zeros(shape, dtype=dtype)
        mask = torch.rand(shape[:sparse_dim], generator=gen) < 0.5
        dense[mask] = (torch.randn(shape, generator=gen) * 10).to(dtype)[mask]
        tensors.append(dense)
    return tensors


def sparse_sum(dense: list, sparse_dim: int, mean: bool = False) -> torch.Tensor:
    """What every rank computes from the gathered rows (the allgatherv simulated)."""
    parts = [_sparse.local_part(d.to_sparse(sparse_dim), "all_reduce") for d in dense]
    flat = np.concatenate([p.rows for p in parts])
    indices, values = _sparse.reduce_rows(flat, [p.nnz for p in parts], parts[0], mean)
    return _sparse.to_tensor(indices, values, dense[0].to_sparse(sparse_dim))


@pytest.mark.parametrize("size", [1, 2, 3, 5])
@pytest.mark.parametrize(
    ("shape", "sparse_dim"), [((40,), 1), ((6, 7), 2), ((5, 3, 2), 1), ((3, 4, 2), 2)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.complex64])
def test_sparse_sum_is_the_dense_sum_in_rank_order(
    size: int, shape: tuple[int, ...], sparse_dim: int, dtype: torch.dtype
) -> None:
    dense = ranks_tensors(size, shape, sparse_dim, dtype)
    got = sparse_sum(dense, sparse_dim)
    want = dense[0].clone()
    for d in dense[1:]:
        want += d  # ((x0 + x1) + x2) ...: bit for bit
    assert got.is_coalesced()
    assert torch.equal(got.to_dense(), want)


def test_sparse_mean_duplicates_and_no_rows() -> None:
    dense = ranks_tensors(3, (20,), 1, torch.float64)
    want = (dense[0] + dense[1] + dense[2]) / 3
    assert torch.allclose(sparse_sum(dense, 1, mean=True).to_dense(), want, rtol=1e-15)
    # uncoalesced input: duplicates summed locally first, as to_dense() would
    dup = torch.sparse_coo_tensor(
        torch.tensor([[1, 1, 3]]), torch.tensor([1.0, 2.0, 4.0]), (5,), check_invariants=True
    )
    part = _sparse.local_part(dup, "all_reduce")
    assert part.nnz == 2
    empty = [torch.zeros(4), torch.zeros(4)]
    assert sparse_sum(empty, 1)._nnz() == 0


def test_sparse_headers_name_what_differs() -> None:
    a = _sparse.local_part(torch.zeros(4).to_sparse(), "x").header
    b = _sparse.local_part(torch.zeros(5).to_sparse(), "x").header
    c = _sparse.local_part(torch.zeros(4, dtype=torch.float64).to_sparse(), "x").header
    assert _sparse.check_headers(np.stack([a, a]), 0, "all_reduce") == [0, 0]
    with pytest.raises(ValueError, match=r"differ in the shape: ranks \[\[0, 2\], \[1\]\]"):
        _sparse.check_headers(np.stack([a, b, a]), 0, "all_reduce")
    with pytest.raises(ValueError, match="differ in the dtype"):
        _sparse.check_headers(np.stack([a, c]), 1, "all_reduce")


# -- the monitored barrier, threads as ranks over one store ------------------------------------
def run_ranks(
    size: int, arrive: list[int], timeout: float, store: MemoryStore | None = None
) -> dict[int, BaseException | None]:
    store = store if store is not None else MemoryStore()
    barriers = [MonitoredBarrier(store, r, size, list(range(size))) for r in range(size)]
    results: dict[int, BaseException | None] = {}

    def rank(r: int) -> None:
        try:
            barriers[r].wait(timeout)
            results[r] = None
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in arrive]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_monitored_barrier_passes_when_all_arrive() -> None:
    assert run_ranks(4, [0, 1, 2, 3], 10.0) == {0: None, 1: None, 2: None, 3: None}


def test_monitored_barrier_names_every_missing_rank() -> None:
    got = run_ranks(4, [0, 2], 0.3)
    assert isinstance(got[0], plait.CommTimeout)
    assert "rank(s) [1, 3] did not arrive within 0.3 s" in str(got[0])
    assert "rank 0 reports that rank(s) [1, 3]" in str(got[2])


def test_monitored_barrier_names_a_missing_rank_0() -> None:
    got = run_ranks(3, [1, 2], 0.2)
    assert all(isinstance(e, plait.CommTimeout) for e in got.values())
    assert "rank(s) [0] did not arrive" in str(got[1])


class SlowVerdict(MemoryStore):
    """A store whose readers of the verdict take a while; records when each read ended."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.read_at: list[float] = []

    def get(self, key: str, timeout: float | None = None) -> bytes:
        value = super().get(key, timeout)
        if key.endswith("/release"):
            time.sleep(self.delay)
            self.read_at.append(time.monotonic())
        return value


def test_monitored_barrier_rank_0_leaves_after_every_rank_read_the_verdict() -> None:
    """Rank 0 serves the store under plait run and env://: leaving at once, it took the store
    with it while the others still read (their reads failed with torch's DistNetworkError)."""
    store = SlowVerdict(0.3)
    barriers = [MonitoredBarrier(store, r, 3, [0, 1, 2]) for r in range(3)]
    done: dict[int, float] = {}

    def rank(r: int) -> None:
        barriers[r].wait(10.0)
        done[r] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(done) == [0, 1, 2]
    assert len(store.read_at) == 2
    assert done[0] >= max(store.read_at), "rank 0 returned before the others read its verdict"
    assert not [k for k in store._data if k.startswith("plait-torch/monitored/")], store._data


class LostStore(MemoryStore):
    """A store whose server went away once the verdict was written (torch's error, as it is)."""

    def get(self, key: str, timeout: float | None = None) -> bytes:
        if key.endswith("/release"):
            super().wait([key], timeout)
            raise RuntimeError(
                "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
                "server shutdown or crash?"
            )
        return super().get(key, timeout)


def test_monitored_barrier_says_the_store_failed_while_reading_the_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # rank 0 waits the longer of the timeout and the grace for rank 1's read, which never comes
    monkeypatch.setattr(_monitored, "_GRACE", 0.2)
    got = run_ranks(2, [0, 1], 2.0, store=LostStore())
    assert isinstance(got[1], plait.RendezvousError), repr(got[1])
    assert "reading rank 0's verdict" in str(got[1])
    assert "Failed to recv" in str(got[1])
    assert isinstance(got[1].__cause__, RuntimeError)
    assert isinstance(got[0], plait.CommTimeout)  # rank 1 arrived but never read it
    assert "rank(s) [1] arrived but did not read the verdict" in str(got[0])


def test_monitored_barrier_keeps_a_missed_verdict_for_the_late_rank() -> None:
    """A rank that missed a barrier reads its verdict when it comes; the keys go once a later
    barrier sees every rank."""
    store = MemoryStore()
    barriers = [MonitoredBarrier(store, r, 2, [0, 1]) for r in range(2)]
    with pytest.raises(plait.CommTimeout, match=r"rank\(s\) \[1\] did not arrive"):
        barriers[0].wait(0.1)
    with pytest.raises(plait.CommTimeout, match=r"rank 0 reports that rank\(s\) \[1\]"):
        barriers[1].wait(5.0)  # late, and told so
    threads = [threading.Thread(target=b.wait, args=(5.0,)) for b in barriers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not [k for k in store._data if k.startswith("plait-torch/monitored/")], store._data


def test_monitored_barrier_needs_a_store() -> None:
    with pytest.raises(plait.UnsupportedError, match="without a store"):
        MonitoredBarrier(None, 0, 2, [0, 1]).wait(1.0)


def test_timeouts_say_timed_out_as_torchs_do() -> None:
    exc = plait.CollectiveTimeout("rank 0: barrier (arena) timed out waiting for rank(s) [1]")
    got = timed_out(exc, "rank 0: barrier", 1.0)
    assert type(got) is plait.CollectiveTimeout
    assert got.__cause__ is exc
    assert str(got).startswith("rank 0: barrier: Timed out after 1 s: rank 0: barrier")


# -- torch's own suite ------------------------------------------------------------------------
@pytest.mark.multiprocess
def test_representative_part_of_torchs_suite(tmp_path: Path) -> None:
    """A fifth of what gloo passes, on plait (about 20 s on 2 cores; the script runs it all)."""
    for module in ("expecttest", "hypothesis"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"torch's test suite needs {module}: pip install -e '.[test]'")
    cmd = [sys.executable, str(SUITE), "--modes", "plait,plait-as-gloo", "--out", str(tmp_path)]
    cmd += ["--tests", ",".join(REPRESENTATIVE), "--test-timeout", "60"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=100, check=False)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    rows = json.loads((tmp_path / "plait-combined.json").read_text())["tests"]
    assert {n: r["outcome"] for n, r in rows.items()} == dict.fromkeys(REPRESENTATIVE, "pass")
