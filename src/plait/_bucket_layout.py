"""Which gradients share a bucket: the layout of a :class:`plait.bucketing.Bucketer`.

A Bucketer is made from each gradient's (shape, dtype), given as a pair or
read from its array; this module checks the pairs (torch dtypes read as plait
reads their tensors) and assigns the gradients to buckets, from the layout
alone (Note [a bucket per dtype]). It needs no communicator: every rank
computes the same buckets by itself.

Note [a bucket per dtype]
    A bucket's buffer holds one dtype. Closing the open bucket at every
    change of dtype in backward order gave a mixed-precision model (float32
    norms and biases between float16 or bfloat16 weights) a bucket per
    gradient, one allreduce each: what bucketing is there to avoid. So, as
    DDP's reducer keeps one open bucket per dtype and device, each dtype has
    an open bucket of its own, filled in ``order``; a gradient that would
    take it past ``bucket_bytes`` closes it and opens the next. One host
    buffer serves gradients of any device (they are staged through the
    host), so the dtype alone is the key. Buckets start in the order they
    complete when gradients come in ``order`` (by the place of their last
    member): a complete bucket then never waits behind one that is still
    filling, as every bucket would wait behind a slowly filling float32 one
    if they started in the order they opened. The assignment depends on the
    layout, ``order`` and ``bucket_bytes`` alone, never on when gradients
    come, so every rank makes the same buckets and starts them alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from plait import _tensor
from plait.ops import check_dtype

__all__ = ["assign", "layout_dtype", "layout_pair", "torch_dtype"]


def assign(
    layout: Sequence[tuple[tuple[int, ...], np.dtype]], order: list[int], bucket_bytes: int
) -> list[list[int]]:
    """Each bucket's gradient indexes, buckets in the order they start (Note [a bucket per
    dtype]): one open bucket per dtype, filled in ``order``; a gradient that would take its
    dtype's bucket past ``bucket_bytes`` closes it and opens the next."""
    done: list[list[int]] = []
    filling: dict[np.dtype, tuple[list[int], int]] = {}  # dtype -> (open bucket, its bytes)
    for i in order:
        shape, dtype = layout[i]
        size = math.prod(shape) * dtype.itemsize
        members, nbytes = filling.get(dtype, ([], 0))
        if members and nbytes + size > bucket_bytes:
            done.append(members)
            members, nbytes = [], 0
        members.append(i)
        filling[dtype] = (members, nbytes + size)
    done.extend(members for members, _ in filling.values())
    place = {i: k for k, i in enumerate(order)}
    return sorted(done, key=lambda members: place[members[-1]])  # as they complete


def torch_dtype(dtype: Any, what: str) -> np.dtype:
    """The numpy dtype plait reads tensors of torch's ``dtype`` as (ml_dtypes' for bfloat16).

    Raises:
        TypeError: a dtype plait cannot move (the message names ``what``).
    """
    import torch

    return np.dtype(_tensor.as_array(torch.empty(0, dtype=dtype), what).dtype)


def layout_pair(pair: tuple[Any, ...], index: int) -> tuple[tuple[int, ...], np.dtype]:
    """A (shape, dtype) pair checked: a tuple of sizes, and a dtype plait can move."""
    what = f"Bucketer: gradient {index}"
    if len(pair) != 2:
        raise TypeError(f"{what}: expected an array or a (shape, dtype) pair; got {pair!r}")
    shape, dtype = pair
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or any(
        isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0 for d in dims
    ):
        raise TypeError(f"{what}: shape must be a tuple of sizes (ints >= 0); got {shape!r}")
    return tuple(int(d) for d in dims), layout_dtype(dtype, what)


def layout_dtype(dtype: Any, what: str) -> np.dtype:
    """The numpy dtype of a (shape, dtype) pair's ``dtype``: numpy's, or torch's (as
    :func:`plait.bucketing.attach` reads a parameter's gradients); one plait can move."""
    if type(dtype).__module__ == "torch":
        return torch_dtype(dtype, what)
    try:
        found: np.dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{what}: {dtype!r} is not a dtype; pass a numpy or torch dtype "
            "(np.float32, torch.float32)"
        ) from None
    try:
        check_dtype(found)
    except TypeError as exc:
        raise TypeError(f"{what}: {exc}") from None
    return found
