"""The fake CUDA device itself: what its counts say must hold for the tests that read them."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed; the plait backend needs it (pip install 'plait[torch]')",
)

from fake_cuda import FakeGpu  # noqa: E402


def test_a_tensor_never_written_counts_no_write_though_written_memory_was_freed() -> None:
    # Writes are counted by address: a tensor made where a written one was freed took its
    # count (a rank's "assert whole.writes == 0" failed about one run in fifteen).
    gpu = FakeGpu(0)
    for _ in range(300):
        out = gpu.tensor(np.zeros(8, np.float32))
        out.copy_(torch.ones(8))
        gpu.synchronize()
        del out
        scratch = [torch.zeros(k) for k in range(1, 9)]  # other allocations in between
        whole = gpu.tensor(np.arange(8, dtype=np.float32))
        assert whole.writes == 0
        del scratch
