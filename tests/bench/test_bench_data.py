"""The bench's input pattern, buffer layouts and wrong-element check."""

from __future__ import annotations

import numpy as np
import pytest

import plait
from plait.bench import data
from plait.bench.data import Buffers, count_wrong, fill, make_buffers, pattern, resolve_dtype
from plait.bench.sweep import COLLECTIVES
from plait.testing import reference

DTYPES = ["float32", "float16", "int8", "uint64", "bool", "complex64", "longdouble"]


@pytest.mark.parametrize("name", DTYPES)
def test_pattern_is_small_positive_and_differs_between_ranks(name: str) -> None:
    dtype = resolve_dtype(name)
    a, b = pattern(0, 0, 600, dtype), pattern(1, 0, 600, dtype)
    assert a.dtype == dtype
    assert a.shape == (600,)
    assert not np.array_equal(a, b)
    if dtype.kind == "b":
        assert 200 < np.count_nonzero(a) < 400  # both values, about as often
    else:
        assert np.all(a.real >= 1)
        assert np.all(a.real <= 251)
    # A block offset shifts the sequence: blocks of one rank are told apart.
    assert not np.array_equal(pattern(0, 0, 64, dtype), pattern(0, 64, 64, dtype))


def test_bfloat16_pattern_is_exact() -> None:
    pytest.importorskip("ml_dtypes")
    dtype = resolve_dtype("bfloat16")
    values = pattern(3, 0, 251, dtype).astype(np.float32)
    assert sorted(values.tolist()) == list(range(1, 252))


def test_resolve_dtype_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float33")


@pytest.mark.parametrize(("n", "start"), [(0, 0), (5, 0), (251 * 4096 * 2 + 17, 0), (3000, 123)])
def test_fill_writes_the_pattern(n: int, start: int) -> None:
    buf = np.zeros(n, np.float32)
    fill(buf, rank=2, start=start)
    np.testing.assert_array_equal(buf, pattern(2, start, n, buf.dtype))


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("in_place", [False, True])
def test_in_place_buffers_share_memory_like_nccl_tests(collective: str, in_place: bool) -> None:
    size, root, count = 3, 1, 12
    for rank in range(size):
        b = make_buffers(collective, rank, size, root, count, np.dtype(np.float32), in_place)
        if b.inp is None or b.out is None:
            continue
        shared = np.shares_memory(b.inp, b.out)
        assert shared == (in_place or collective == "broadcast"), (collective, rank)
        if collective in ("allgather", "gather") and in_place:
            assert b.inp.ctypes.data == b.out[rank * 4 :].ctypes.data


def _results(
    collective: str, size: int, root: int, count: int, dtype: np.dtype, op: plait.Op, in_place: bool
) -> list[Buffers]:
    """Each rank's buffers after the collective, computed with the numpy reference."""
    bufs = [make_buffers(collective, r, size, root, count, dtype, in_place) for r in range(size)]
    for r, b in enumerate(bufs):
        b.reset(collective, r, root)
    if collective == "barrier":
        return bufs
    inputs = []
    for r, b in enumerate(bufs):
        if collective == "broadcast":
            inputs.append(b.out.copy() if r == root else None)  # type: ignore[union-attr]
        elif collective == "scatter" and r != root:
            inputs.append(None)
        else:
            inputs.append(b.inp.copy())  # type: ignore[union-attr]
    if collective == "scatter":
        inputs = [inputs[root]] * size
    expected = reference(collective, inputs, op=op, root=root)
    for b, want in zip(bufs, expected, strict=True):
        if want is not None:
            assert b.out is not None
            b.out[...] = want.reshape(-1)
    return bufs


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("in_place", [False, True])
def test_count_wrong_is_zero_on_the_reference_and_counts_corruption(
    collective: str, in_place: bool
) -> None:
    size, root, count, dtype, op = 3, 2, 30, np.dtype(np.float32), plait.SUM
    bufs = _results(collective, size, root, count, dtype, op, in_place)
    checked = 0
    for r, b in enumerate(bufs):
        assert count_wrong(collective, r, size, root, op, count, b.out, dtype) == 0
        if collective != "barrier" and b.out is not None and b.out.size:
            b.out[[0, -1]] += 1
            assert count_wrong(collective, r, size, root, op, count, b.out, dtype) == 2
            checked += 1
    if collective != "barrier":
        assert checked >= 1


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("float16", plait.SUM),
        ("float64", plait.AVG),
        ("int8", plait.PROD),
        ("uint16", plait.BXOR),
        ("bool", plait.BAND),
        ("complex64", plait.SUM),
        ("int32", plait.MIN),
    ],
)
def test_count_wrong_across_dtypes_and_ops(name: str, op: plait.Op) -> None:
    dtype = resolve_dtype(name)
    size, count = 4, 1000
    bufs = _results("allreduce", size, 0, count, dtype, op, False)
    assert count_wrong("allreduce", 1, size, 0, op, count, bufs[1].out, dtype) == 0
    bufs[1].out[7] = bufs[1].out[8] if dtype.kind == "b" else 0  # type: ignore[index]
    assert count_wrong("allreduce", 1, size, 0, op, count, bufs[1].out, dtype) >= 1


def test_count_wrong_works_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "_CHUNK", 7)
    size, count, dtype = 2, 40, np.dtype(np.int64)
    bufs = _results("alltoall", size, 0, count, dtype, plait.SUM, False)
    assert count_wrong("alltoall", 1, size, 0, plait.SUM, count, bufs[1].out, dtype) == 0
    bufs[1].out[[3, 21, 39]] = -1  # type: ignore[index]
    assert count_wrong("alltoall", 1, size, 0, plait.SUM, count, bufs[1].out, dtype) == 3
