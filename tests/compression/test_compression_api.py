"""``allreduce(compression=...)`` at the API edge: checks, out=, async_op, and ``comm.stats()``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import plait
from plait.communicator import Stats
from plait.compression import BF16, FP16, Int8, Keyed, PowerSGD, TopK
from plait.testing import run_ranks


def test_bad_calls_are_refused_before_any_byte_moves() -> None:
    def body(comm: plait.Communicator) -> None:
        x = np.ones(8, np.float32)
        before = comm.stats()
        cases: list[tuple[type[Exception], str, dict[str, Any], Any]] = [
            (TypeError, "float16, float32 or float64", {}, np.ones(8, np.int32)),
            (TypeError, "float16, float32 or float64", {}, np.ones(8, np.complex64)),
            (ValueError, "SUM and plait.AVG", {"op": plait.MAX}, x),
            (ValueError, "algorithm='auto'", {"algorithm": "ring"}, x),
            (TypeError, "out has dtype", {"out": np.empty(8, np.float64)}, x),
        ]
        for exc, match, kwargs, arr in cases:
            with pytest.raises(exc, match=match):
                comm.allreduce(arr, compression=FP16(), **kwargs)
        with pytest.raises(TypeError, match=r"plait\.compression compressor"):
            comm.allreduce(x, compression="fp16")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="with_key"):
            comm.allreduce(memoryview(x), compression=TopK(0.5))  # no identity to key state by
        assert comm.stats() == before
        # ... and the communicator is still usable
        np.testing.assert_array_equal(comm.allreduce(x, compression=FP16()), x * comm.size)

    run_ranks(2, body)


def test_constructor_arguments_are_checked() -> None:
    for bad, match in (
        (lambda: Int8(0), "block_size"),
        (lambda: Int8(True), "block_size"),
        (lambda: TopK(0), "ratio"),
        (lambda: TopK(1.5), "ratio"),
        (lambda: PowerSGD(0), "rank"),
        (lambda: PowerSGD(1, min_compression_rate=0.5), "min_compression_rate"),
    ):
        with pytest.raises(ValueError, match=match):
            bad()
    # A seed np.random.default_rng would refuse at the first call, refused when it is made.
    for make in (lambda s: Int8(stochastic=True, seed=s), lambda s: PowerSGD(1, seed=s)):
        with pytest.raises(ValueError, match=r": seed must be a non-negative int; got -1"):
            make(-1)
        with pytest.raises(TypeError, match=r"seed must be a non-negative int; got 1\.7"):
            make(1.7)  # was taken as 1
        assert make(np.int64(7)).seed == 7
    with pytest.raises(TypeError):
        TopK().with_key(["unhashable"])  # type: ignore[arg-type]
    keyed = TopK().with_key("a").with_key("b")
    assert isinstance(keyed, Keyed)
    assert keyed.key == "b"
    assert not isinstance(keyed.inner, Keyed)
    assert "with_key('b')" in repr(keyed)


@pytest.mark.parametrize("make", [FP16, BF16, Int8, lambda: TopK(0.2), lambda: PowerSGD(1)])
def test_out_and_in_place(make: Any) -> None:
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((40, 30)).astype(np.float32) for _ in range(3)]

    def body(comm: plait.Communicator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        plain = comm.allreduce(xs[comm.rank], compression=make().with_key("a"))
        out = np.empty((40, 30), np.float32)
        res = comm.allreduce(xs[comm.rank], compression=make().with_key("b"), out=out)
        assert res is out
        x = xs[comm.rank].copy()
        res2 = comm.allreduce(x, compression=make().with_key("c"), out=x)
        assert res2 is x
        return plain, out, x

    for plain, out, inplace in run_ranks(3, body):
        np.testing.assert_array_equal(plain, out)
        np.testing.assert_array_equal(plain, inplace)


def test_async_calls_keep_their_place_among_other_calls() -> None:
    # A compressed async call makes several collectives on the worker thread while the
    # caller goes on making blocking and async calls: every call must still meet its match.
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(4)]

    def body(comm: plait.Communicator) -> list[np.ndarray]:
        methods = [FP16(), Int8(32), TopK(0.1), PowerSGD(2)]
        works = []
        sync = []
        for step in range(3):
            for i, c in enumerate(methods):
                works.append(
                    comm.allreduce(xs[comm.rank], compression=c.with_key(i), async_op=True)
                )
                sync.append(comm.allreduce(np.full(3, float(step + comm.rank))))
            works.append(comm.allgather(np.array([comm.rank]), async_op=True))
        return [w.wait(timeout=60) for w in works] + sync

    results = run_ranks(4, body)
    for r, res in enumerate(results):
        for a, b in zip(res, results[0], strict=True):
            assert a.tobytes() == b.tobytes(), f"rank {r}"

    # The same calls made blocking give the same results.
    def blocking(comm: plait.Communicator) -> list[np.ndarray]:
        methods = [FP16(), Int8(32), TopK(0.1), PowerSGD(2)]
        out = []
        for _ in range(3):
            out.extend(
                comm.allreduce(xs[comm.rank], compression=c.with_key(i))
                for i, c in enumerate(methods)
            )
        return out

    want = run_ranks(4, blocking)[0]
    got = [a for i, a in enumerate(results[0][:15]) if i % 5 != 4]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_async_error_is_reported_by_wait() -> None:
    def body(comm: plait.Communicator) -> None:
        c = TopK(0.5).with_key("k")
        comm.allreduce(np.ones(4, np.float32), compression=c)
        with pytest.raises(ValueError, match="own key"):  # checked at the call, not in wait()
            comm.allreduce(np.ones(5, np.float32), compression=c, async_op=True)
        full = TopK(1.0).with_key("k")
        w = comm.allreduce(np.ones(4, np.float32), plait.AVG, compression=full, async_op=True)
        np.testing.assert_array_equal(w.wait(), np.ones(4))
        assert w.done()

    run_ranks(2, body)


def test_detail_mode_runs_compressed_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_DEBUG", "detail")

    def body(comm: plait.Communicator) -> np.ndarray:
        w = comm.allreduce(np.ones(64, np.float32), compression=Int8(16), async_op=True)
        return w.wait()

    for res in run_ranks(2, body):
        np.testing.assert_array_equal(res, np.full(64, 2.0))


# -- stats ----------------------------------------------------------------------------------------
def test_stats_counts_payload_bytes_and_subtracts() -> None:
    def body(comm: plait.Communicator) -> tuple[Stats, Stats, Stats]:
        start = comm.stats()
        comm.allreduce(np.ones(1 << 14, np.float32), algorithm="ring")
        mid = comm.stats()
        sub = comm.split(0)
        sub.allgather(np.ones(10, np.float64))
        return start, mid - start, comm.stats() - mid

    for start, ring, sub in run_ranks(4, body):
        assert start == Stats(0, 0)
        assert ring == Stats(2 * 3 * (1 << 14), 2 * 3 * (1 << 14))  # 2 (p-1)/p * 64 KiB
        # the group's traffic shows on the parent's counters (the split's own allgather too)
        assert sub.bytes_sent >= 3 * 80
    assert Stats(5, 7) - Stats(2, 3) == Stats(3, 4)
    assert Stats(5, 7) + Stats(2, 3) == Stats(7, 10)


def test_public_names() -> None:
    import plait.compression

    assert set(plait.compression.__all__) == {
        "BF16",
        "FP16",
        "Compressor",
        "Int8",
        "Keyed",
        "PowerSGD",
        "TopK",
    }
    assert not any(c().stateful for c in (FP16, BF16, Int8))
    assert all(c.stateful for c in (TopK(), PowerSGD()))
