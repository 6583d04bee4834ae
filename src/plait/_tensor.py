"""torch CPU tensors as numpy arrays over the same memory, and back, without importing torch.

Both edges that take tensors use this: the communicator (``comm.allreduce(tensor)``) and
the torch.distributed backend (``plait.torch``). torch is imported only once a tensor has
been seen, that is, once the caller has imported it. Tensors on a GPU reach it as host
copies (``plait._arrays``, Note [staging through the host]; ``plait.torch._staging``,
Note [tensors on a GPU]).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["as_array", "check_values", "is_tensor", "like"]


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch.

    Only a loaded torch can have made one, so torch's entry in ``sys.modules``
    decides (subclasses such as ``torch.nn.Parameter`` included).
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, getattr(torch, "Tensor", ()))


def as_array(t: Any, where: str, refuse: type[Exception] = TypeError) -> np.ndarray:
    """A numpy array over CPU tensor ``t``'s memory (no copy).

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
    if t.dtype == torch.bfloat16:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"{where} is a bfloat16 tensor, which plait moves with the ml_dtypes package: "
                "pip install 'plait[bfloat16]'"
            ) from None
        bf16: np.ndarray = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return bf16
    try:
        arr: np.ndarray = t.numpy()
        return arr
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"{where} has dtype {t.dtype}, which plait cannot move ({exc})") from None


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
