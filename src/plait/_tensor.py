"""torch CPU tensors as numpy arrays over the same memory, and back, without importing torch.

Both edges that take tensors use this: the communicator (``comm.allreduce(tensor)``) and
the torch.distributed backend (``plait.torch``). torch is imported only once a tensor has
been seen, that is, once the caller has imported it. Tensors on a GPU reach it as host
copies (``plait._arrays``, Note [staging through the host]; ``plait.torch._staging``,
Note [tensors on a GPU]).

Note [arrays over a tensor's memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``Tensor.numpy()`` marks the tensor's storage as not resizable, for good (torch does it
so that the array never points at freed memory). A tensor that went through plait once
could then never be resized again: ``t.resize_(n)`` and ``storage.resize_(0)`` raised
"Trying to resize storage that is not resizable", and FSDP's sharded strategies, which
free and re-allocate their parameters' storage that way around every all-gather, failed
on their first step. So :func:`over` reads a tensor without ``.numpy()``: numpy gets the
array interface of the tensor's memory (address, shape, strides, numpy's dtype for the
tensor's; :func:`numpy_dtype`), from an object that holds the tensor and that the array
keeps as its ``base``. The array is the same memory as ``.numpy()``'s and keeps the
tensor alive; it takes about 0.7 µs more to make (about 2 µs in all, checks included).
What it does not do is stop the tensor's owner from resizing the storage while a call
still uses the array: as with torch's own backends, a tensor must be left alone until
its call is done.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["as_array", "check_values", "held", "is_tensor", "like", "numpy_dtype", "over"]


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch.

    Only a loaded torch can have made one, so torch's entry in ``sys.modules``
    decides (subclasses such as ``torch.nn.Parameter`` included).
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, getattr(torch, "Tensor", ()))


def as_array(t: Any, where: str, refuse: type[Exception] = TypeError) -> np.ndarray:
    """A numpy array over CPU tensor ``t``'s memory (no copy; the tensor stays resizable).

    Detaches a tensor that requires grad (the same memory; collectives are not
    differentiable, as in torch.distributed). bfloat16, which numpy lacks, becomes
    ml_dtypes' bfloat16 over the same bytes.

    Raises:
        refuse: a tensor plait cannot read as it is (on another device, sparse,
            quantized, a lazy conjugate or negation); the message, prefixed with
            ``where``, says what to call first.
        TypeError: a dtype numpy cannot hold, or bfloat16 without ml_dtypes.
    """
    import torch

    if not t.is_cpu:  # t.device.type != "cpu", at a sixth of the cost
        # Tensors on a GPU are staged through a host copy before they get here
        # (plait._arrays for the communicator, plait.torch._staging for the torch
        # backend); what is left has no data to read (meta) or cannot be copied.
        raise refuse(
            f"{where} is a tensor on {t.device}, which has no data plait can read: plait "
            "reads CPU tensors only, and tensors on a GPU through a host copy; pass a tensor "
            "with data (.cpu())"
        )
    if t.layout != torch.strided:
        raise refuse(
            f"{where} has layout {t.layout}; plait reads dense (strided) tensors only: call "
            ".to_dense() first"
        )
    check_values(t, where, refuse)
    if t.requires_grad:
        t = t.detach()
    return over(t, where)


def over(t: Any, where: str) -> np.ndarray:
    """A numpy array over dense CPU tensor ``t``'s memory, its shape and strides; ``t``
    stays resizable (Note [arrays over a tensor's memory]).

    Raises:
        TypeError: a dtype numpy cannot hold, bfloat16 without ml_dtypes, or a tensor
            without memory of its own to read (a wrapper subclass).
    """
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        dtype = numpy_dtype(t.dtype, where)
    try:
        address = t.data_ptr()
    except RuntimeError as exc:
        raise TypeError(f"{where} has no memory plait can read ({exc})") from None
    if address == 0:  # no memory: an array interface at NULL is no array over it
        if t.numel() == 0:  # (an empty tensor's pointer may be NULL): nothing to read
            return np.empty(tuple(t.shape), dtype)
        raise TypeError(
            f"{where} has no memory plait can read (its storage was freed, or it is a "
            "wrapper of other tensors)"
        )
    size = dtype.itemsize
    memory = _Memory()
    memory.tensor = t
    memory.__array_interface__ = {
        "version": 3,
        "shape": t.shape,  # a torch.Size: a tuple
        # numpy's own type of the width where numpy cannot name dtype (bfloat16's '<V2')
        "typestr": dtype.str if dtype.kind != "V" else f"<u{size}",
        "data": (address, False),
        "strides": None if t.is_contiguous() else tuple(s * size for s in t.stride()),
    }
    arr: np.ndarray = np.asarray(memory)
    return arr if arr.dtype is dtype else arr.view(dtype)


def held(x: Any) -> Any:
    """The tensor whose memory ``x`` is, when ``x`` is the ``base`` of an array that
    :func:`over` made; None for anything else."""
    return x.tensor if type(x) is _Memory else None


class _Memory:
    """What :func:`over` hands numpy: the array interface of a tensor's memory, and the tensor.

    The array numpy makes keeps this object as its ``base``, so the tensor (and with it
    its memory) lives as long as the array does.
    """

    __slots__ = ("__array_interface__", "tensor")

    __array_interface__: dict[str, Any]
    tensor: Any


#: numpy's dtype for each torch dtype numpy can hold (the table of torch's ``Tensor.numpy()``),
#: filled on first use; bfloat16 (ml_dtypes') is not kept here.
_DTYPES: dict[Any, np.dtype] = {}
_FILLED = False  # whether _DTYPES holds them all
_NUMPY_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


def numpy_dtype(dtype: Any, where: str) -> np.dtype:
    """numpy's dtype for torch dtype ``dtype``: the same bytes, ml_dtypes' for bfloat16.

    Raises:
        TypeError: a dtype numpy cannot hold, or bfloat16 without ml_dtypes.
    """
    known = _DTYPES.get(dtype)
    if known is not None:
        return known
    import torch

    global _FILLED
    if not _FILLED:  # filled whole, in one step, by whichever thread comes first (or both):
        # filled in turn, a thread that found it begun read a dtype it lacked yet as one
        # plait cannot move
        _DTYPES.update(
            {getattr(torch, n): np.dtype(n) for n in _NUMPY_NAMES if hasattr(torch, n)}
        )  # (the unsigned ones from torch 2.3 on)
        _FILLED = True
        known = _DTYPES.get(dtype)
        if known is not None:
            return known
    if dtype == torch.bfloat16:  # asked for each time: whether ml_dtypes imports may change
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{where} is a bfloat16 tensor, which plait moves with the ml_dtypes package: "
                "pip install 'plait[bfloat16]'"
            ) from None
        bf16: np.dtype = np.dtype(ml_dtypes.bfloat16)
        return bf16
    raise TypeError(f"{where} has dtype {dtype}, which plait cannot move (numpy has no such type)")


def check_values(t: Any, where: str, refuse: type[Exception]) -> None:
    """Refuse a tensor whose memory does not hold its values as they read.

    A quantized tensor holds integers and scales, a lazily conjugated or
    negated view its source's values; the message says what to call first.
    """
    if t.is_quantized:
        raise refuse(f"{where} is quantized ({t.dtype}); dequantize it first")
    if t.is_conj() or t.is_neg():
        raise refuse(
            f"{where} is a lazily conjugated or negated view: call .resolve_conj() and "
            ".resolve_neg() first"
        )


def like(src: Any, new: np.ndarray) -> Any:
    """``new``, a call's fresh result, in the type of the caller's ``src``.

    A torch tensor for a tensor, sharing ``new``'s memory; ``new`` itself otherwise.
    """
    if not is_tensor(src):
        return new
    import torch

    if new.dtype.kind == "V":  # ml_dtypes' bfloat16, the only such dtype a tensor gives
        return torch.from_numpy(new.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(new)
