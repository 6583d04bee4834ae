"""What a collective returns: the type of its input (a torch tensor for a tensor), or ``out``.

The rule (communicator.py, Note [result types]): ``out=`` given -> ``out`` itself;
broadcast and recv -> the ``x``/``buf`` they fill; otherwise a new array in the type
of ``x``: a torch CPU tensor over the new numpy array's memory for a tensor, a numpy
array for numpy arrays and every other array-like. bfloat16 tensors travel as
ml_dtypes' bfloat16 over the same bytes. torch stays an optional import.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import plait
from plait.testing import memory_communicators, run_ranks

torch = pytest.importorskip("torch")

SIZE = 2
DTYPES = [torch.float32, torch.int64, torch.bool]


def make(rank: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A tensor of ``shape`` whose values depend on the rank (a mix of True/False for bool)."""
    n = int(np.prod(shape))
    base = torch.arange(n).reshape(shape) * (rank + 1) + rank
    return (base % 3 == 0) if dtype == torch.bool else base.to(dtype)


def same(t: Any, want: np.ndarray, dtype: Any) -> None:
    """``t`` is a torch tensor of ``dtype`` holding ``want``."""
    assert isinstance(t, torch.Tensor), type(t)
    assert t.dtype == dtype
    assert t.device.type == "cpu"
    np.testing.assert_array_equal(t.numpy(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_collective_returns_a_tensor_for_a_tensor(dtype: Any) -> None:
    """Each call is made twice, on the tensor and on a numpy copy: same values, tensor type.

    A fresh result tensor is made before the call runs (torch.from_numpy over the
    array plait then writes), so its holding the right values shows it shares
    that array's memory: a copy would hold whatever was there before.
    """

    def body(comm: plait.Communicator) -> None:
        t = make(comm.rank, (SIZE * 2, 3), dtype)
        x = t.numpy().copy()
        same(comm.allreduce(t), comm.allreduce(x), dtype)
        got = comm.reduce(t, root=1)
        want = comm.reduce(x, root=1)
        if comm.rank == 1:
            same(got, want, dtype)
        else:
            assert got is None
            assert want is None
        same(comm.reduce_scatter(t), comm.reduce_scatter(x), dtype)
        same(comm.allgather(t), comm.allgather(x), dtype)
        same(comm.alltoall(t), comm.alltoall(x), dtype)
        got, want = comm.gather(t, root=0), comm.gather(x, root=0)
        if comm.rank == 0:
            same(got, want, dtype)
        else:
            assert got is None
            assert want is None
        same(comm.scatter(t, root=1), comm.scatter(x, root=1), dtype)
        # Async: the Work's result is what the blocking call returns.
        same(comm.allreduce(t, async_op=True).wait(), comm.allreduce(x), dtype)
        same(comm.allgather(t, async_op=True).wait(), comm.allgather(x), dtype)
        # The input is never modified by a call without out=.
        np.testing.assert_array_equal(t.numpy(), x)

    run_ranks(SIZE, body)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_calls_that_fill_a_tensor_return_it(dtype: Any) -> None:
    """broadcast, recv, out= and out=x (in place): the caller's own tensor, written in place."""

    def body(comm: plait.Communicator) -> None:
        b = make(comm.rank, (4,), dtype)
        ptr = b.data_ptr()
        assert comm.broadcast(b, root=0) is b
        assert b.data_ptr() == ptr
        np.testing.assert_array_equal(b.numpy(), make(0, (4,), dtype).numpy())

        t = make(comm.rank, (SIZE, 3), dtype)
        want = comm.allreduce(t.numpy().copy())
        o = torch.zeros((SIZE, 3), dtype=dtype)
        assert comm.allreduce(t, out=o) is o
        np.testing.assert_array_equal(o.numpy(), want)
        assert comm.allreduce(t, out=t) is t  # in place, in the tensor's memory
        np.testing.assert_array_equal(t.numpy(), want)

        g = torch.zeros((SIZE, SIZE, 3), dtype=dtype)
        assert comm.allgather(t, out=g) is g
        np.testing.assert_array_equal(g.numpy(), np.stack([want] * SIZE))
        w = comm.alltoall(t, out=torch.empty_like(t), async_op=True)
        assert isinstance(w.wait(), torch.Tensor)

        # scatter on a non-root with x=None and a tensor out: out itself.
        part = torch.zeros((1, 3), dtype=dtype)
        src = make(0, (SIZE, 3), dtype)
        assert comm.scatter(src if comm.rank == 0 else None, root=0, out=part) is part
        np.testing.assert_array_equal(part.numpy(), src.numpy()[comm.rank : comm.rank + 1])

        if comm.rank == 0:
            comm.send(make(0, (5,), dtype), dst=1, tag=3)
            return
        buf = torch.zeros(5, dtype=dtype)
        assert comm.recv(buf, src=0, tag=3) is buf
        np.testing.assert_array_equal(buf.numpy(), make(0, (5,), dtype).numpy())

    run_ranks(SIZE, body)


def test_out_decides_the_type_when_given() -> None:
    """out= is returned as passed: a numpy out for a tensor x, a tensor out for a numpy x."""

    def body(comm: plait.Communicator) -> None:
        t = torch.ones(3)
        out_np = np.empty(3, np.float32)
        assert comm.allreduce(t, out=out_np) is out_np
        out_t = torch.empty(3)
        assert comm.allreduce(t.numpy(), out=out_t) is out_t
        np.testing.assert_array_equal(out_t.numpy(), np.full(3, SIZE, np.float32))
        res = comm.reduce(t, root=0, out=torch.empty(3))
        assert (res is None) == (comm.rank != 0)

    run_ranks(SIZE, body)


def test_other_array_likes_give_numpy_arrays() -> None:
    def body(comm: plait.Communicator) -> None:
        assert type(comm.allreduce(np.ones(2))) is np.ndarray
        assert type(comm.allreduce([1, 2])) is np.ndarray
        mv = memoryview(bytearray(np.ones(2, np.int32).tobytes())).cast("i")
        assert type(comm.allgather(mv)) is np.ndarray
        assert type(comm.allreduce(np.float64(2.0))) is np.ndarray

    run_ranks(SIZE, body)


def test_strided_and_grad_tensors() -> None:
    """A transposed view is staged and written back; a tensor that requires grad is detached."""

    def body(comm: plait.Communicator) -> None:
        base = torch.arange(12.0).reshape(3, 4) * (comm.rank + 1)
        view = base.T  # (4, 3), not contiguous
        want = (torch.arange(12.0).reshape(3, 4) * 3).T.numpy()
        res = comm.allreduce(view)
        same(res, want, torch.float32)
        assert res.shape == (4, 3)
        assert comm.allreduce(view, out=view) is view
        np.testing.assert_array_equal(base.T.numpy(), want)

        p = torch.nn.Parameter(torch.ones(3))
        res = comm.allreduce(p)
        same(res, np.full(3, SIZE, np.float32), torch.float32)
        assert not res.requires_grad

    run_ranks(SIZE, body)


def resizable(t: Any, what: str) -> None:
    """``t`` can still be resized, grown and its storage freed and re-allocated (FSDP's way)."""
    n = t.numel()
    try:
        t.resize_(2 * n)
        storage = t.untyped_storage()
        storage.resize_(0)
        storage.resize_(2 * n * t.element_size())
    except RuntimeError as exc:  # "Trying to resize storage that is not resizable"
        raise AssertionError(f"{what}: {exc}") from None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tensors_stay_resizable_after_a_call(dtype: Any) -> None:
    """A tensor plait read or wrote can be resized afterwards; ``Tensor.numpy()`` had marked
    its storage unresizable for good. (No ``.numpy()`` here: it would do the same.)"""
    if dtype == torch.bfloat16:
        pytest.importorskip("ml_dtypes")

    def body(comm: plait.Communicator) -> None:
        x = torch.full((4,), float(comm.rank + 1), dtype=dtype)
        comm.allreduce(x, out=x)
        assert x.tolist() == [3.0] * 4
        resizable(x, "allreduce in place")
        y = torch.ones(6, dtype=dtype)
        out = torch.empty((SIZE, 6), dtype=dtype)
        comm.allgather(y, out=out)
        resizable(y, "allgather's input")
        resizable(out, "allgather's out")
        b = torch.full((3,), float(comm.rank), dtype=dtype)
        comm.broadcast(b, root=1)
        assert b.tolist() == [1.0] * 3
        resizable(b, "broadcast")
        w = comm.allreduce(torch.ones(5, dtype=dtype), async_op=True)
        resizable(w.wait().clone(), "a copy of an async result")
        sent = torch.arange(300_000, dtype=dtype)  # over 1 MiB: a message of its own
        got = comm.bcast_object({"t": sent, "small": torch.ones(3)}, root=0)
        assert torch.equal(got["t"], sent)
        resizable(sent, "bcast_object's tensor on the root")
        resizable(got["t"], "bcast_object's received tensor")
        resizable(got["small"], "bcast_object's received small tensor")
        every = comm.allgather_object(torch.full((2000,), float(comm.rank), dtype=dtype))
        for r, t in enumerate(every):
            assert t.tolist() == [float(r)] * 2000
            resizable(t, f"allgather_object's tensor of rank {r}")

    run_ranks(SIZE, body)


def test_compressed_allreduce_of_a_tensor() -> None:
    from plait.compression import FP16

    def body(comm: plait.Communicator) -> None:
        t = torch.full((8,), float(comm.rank + 1))
        same(comm.allreduce(t, compression=FP16()), np.full(8, 3.0, np.float32), torch.float32)
        out = torch.empty(8)
        assert comm.allreduce(t, plait.AVG, out=out, compression=FP16()) is out
        np.testing.assert_array_equal(out.numpy(), np.full(8, 1.5, np.float32))
        w = comm.allreduce(t, compression=FP16(), async_op=True)
        same(w.wait(), np.full(8, 3.0, np.float32), torch.float32)

    run_ranks(SIZE, body)


def test_tensors_plait_cannot_read_are_refused_with_what_to_do() -> None:
    (comm,) = memory_communicators(1)
    with comm:
        with pytest.raises(TypeError, match=r"x is a tensor on meta.*\.cpu\(\)"):
            comm.allreduce(torch.empty(3, device="meta"))
        with pytest.raises(TypeError, match=r"to_dense"):
            comm.allreduce(torch.ones(3).to_sparse())
        with pytest.raises(TypeError, match=r"resolve_conj"):
            comm.allreduce(torch.ones(3, dtype=torch.complex64).conj())
        if hasattr(torch, "float8_e4m3fn"):
            with pytest.raises(TypeError, match=r"float8_e4m3fn, which plait cannot move"):
                comm.allreduce(torch.ones(3).to(torch.float8_e4m3fn))
        with pytest.raises(TypeError, match=r"out is a tensor on meta"):
            comm.allreduce(torch.ones(3), out=torch.empty(3, device="meta"))


def test_a_tensor_whose_storage_was_freed_is_refused_and_an_empty_one_is_read() -> None:
    """A tensor of elements with no memory (its storage freed with ``resize_(0)``, as FSDP
    frees a shard) reached numpy as an array interface at NULL: numpy's own ValueError, or
    with numpy before 2.4 an array that was not the tensor's memory; an empty tensor (its
    pointer NULL too) failed there with numpy before 2.4."""
    (comm,) = memory_communicators(1)
    with comm:
        freed = torch.ones(4)
        freed.untyped_storage().resize_(0)
        with pytest.raises(TypeError, match=r"x has no memory plait can read \(its storage"):
            comm.allreduce(freed)
        for empty in (torch.empty(0), torch.empty(0, 3), torch.empty(0, dtype=torch.bool)):
            assert empty.data_ptr() == 0 or empty.numel() == 0
            got = comm.allreduce(empty)
            assert isinstance(got, torch.Tensor)
            assert (got.shape, got.dtype) == (empty.shape, empty.dtype)


def test_the_dtype_table_is_filled_whole_by_a_thread_that_finds_it_in_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table of torch's dtypes was filled one entry at a time on first use, and a second
    thread that found it begun read any dtype not in it yet as one plait cannot move."""
    from plait import _tensor

    monkeypatch.setattr(_tensor, "_DTYPES", {torch.int8: np.dtype(np.int8)})
    monkeypatch.setattr(_tensor, "_FILLED", False)
    assert _tensor.numpy_dtype(torch.float32, "t") == np.dtype(np.float32)
    assert _tensor.over(torch.ones(2, dtype=torch.float64), "t").dtype == np.float64


# -- bfloat16 ---------------------------------------------------------------------------


def test_bfloat16_tensors() -> None:
    pytest.importorskip("ml_dtypes")

    def body(comm: plait.Communicator) -> None:
        t = torch.full((2, 3), float(comm.rank + 1), dtype=torch.bfloat16)
        same_bf16(comm.allreduce(t), torch.full((2, 3), 3.0, dtype=torch.bfloat16))
        same_bf16(comm.allgather(t), torch.stack([torch.full((2, 3), v + 1.0) for v in range(2)]))
        same_bf16(
            comm.allreduce(t, plait.MAX, async_op=True).wait(),
            torch.full((2, 3), 2.0, dtype=torch.bfloat16),
        )
        ptr = t.data_ptr()
        assert comm.allreduce(t, out=t) is t
        assert t.data_ptr() == ptr
        same_bf16(t, torch.full((2, 3), 3.0, dtype=torch.bfloat16))
        b = torch.full((4,), float(comm.rank), dtype=torch.bfloat16)
        assert comm.broadcast(b, root=1) is b
        same_bf16(b, torch.ones(4, dtype=torch.bfloat16))

    run_ranks(SIZE, body)


def same_bf16(t: Any, want: Any) -> None:
    assert isinstance(t, torch.Tensor), type(t)
    assert t.dtype == torch.bfloat16
    assert torch.equal(t, want.to(torch.bfloat16))


def test_bfloat16_without_ml_dtypes_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ml_dtypes missing (an import of it fails), the error gives advice that works."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    (comm,) = memory_communicators(1)
    with comm, pytest.raises(TypeError) as info:
        comm.allreduce(torch.ones(3, dtype=torch.bfloat16))
    msg = str(info.value)
    assert "pip install 'plait[bfloat16]'" in msg
    assert ".numpy()" not in msg  # the old advice, which fails for bfloat16 itself
    # The advice works: the extra exists and brings ml_dtypes.
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("ml_dtypes") for req in extras["bfloat16"])


def test_result_tensors_share_the_result_arrays_memory() -> None:
    """The conversion itself: torch.from_numpy, no copy, bfloat16 included."""
    from plait._tensor import like as _result_like

    new = np.zeros(3, np.float32)
    t = _result_like(torch.ones(1), new)
    new[1] = 7
    assert isinstance(t, torch.Tensor)
    assert t[1].item() == 7
    ml_dtypes = pytest.importorskip("ml_dtypes")
    new16 = np.zeros(3, ml_dtypes.bfloat16)
    t16 = _result_like(torch.ones(1, dtype=torch.bfloat16), new16)
    new16[2] = 2.5
    assert t16.dtype == torch.bfloat16
    assert t16[2].item() == 2.5
    assert _result_like([1.0], new) is new


def test_plait_never_imports_torch_for_numpy_or_lists() -> None:
    code = (
        "import sys, numpy as np, plait\n"
        "from plait.testing import memory_communicators\n"
        "(comm,) = memory_communicators(1)\n"
        "comm.allreduce(np.ones(2)); comm.allreduce([1, 2]); comm.allgather(memoryview(b'ab'))\n"
        "comm.broadcast(np.ones(2)); comm.close()\n"
        "assert 'torch' not in sys.modules, 'plait imported torch'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
