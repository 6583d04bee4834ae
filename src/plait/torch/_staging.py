"""Tensors off the CPU at the torch backend: staged through the host, as gloo stages them.

Note [tensors on a GPU]
    The "plait" backend is registered for the "cpu" and "cuda" device types,
    so ``init_process_group("plait")`` serves CUDA tensors too, and every
    call of the group takes a tensor on any device whose tensors support
    ``.cpu()`` and ``copy_``. plait runs on host memory, so such a tensor is
    served through a host copy (:func:`host_copy`, :func:`host_output`, with
    the helpers of ``plait._arrays``, Note [staging through the host]):

    - **Inputs** are copied to the host at the call, on the caller's thread
      (``tensor.cpu()``, which waits for the work queued on the tensor's
      stream): the call sends what the program wrote before it, whatever
      kernels change the tensor afterwards, also with ``async_op=True``.
    - **Outputs** (all_reduce's tensor, broadcast's off the source, the
      output tensors and lists, a receive's tensor) get a host buffer, which
      holds the tensor's contents only where the call reads them too
      (all_reduce, reduce's on the root, all_reduce_coalesced); the call
      runs on it. Once the call has succeeded, the work's finish step
      (:func:`then_write_back`) copies the results into the same tensors
      (``copy_``, in place: views and strided tensors keep their memory) and
      then synchronises each device (``torch.cuda.synchronize(device)``),
      all before the work completes: before a blocking call returns, before
      ``wait()`` returns, ``is_completed()`` says True or the future
      completes (DDP chains on the future). A failed call writes nothing
      back: the tensors keep their contents.

    gloo serves CUDA tensors the same way (through pinned host copies) with
    weaker waits: it copies in and back on streams of its own, and its
    ``wait()`` only makes the caller's current stream wait for the copy back
    (an event), without blocking the host. Here ``wait()`` (and a blocking
    call) blocks until the results are in device memory, so the tensors may
    be used at once on any stream and by the host. The copy in blocks the
    calling thread until the tensor's stream reaches the call, where gloo's
    is asynchronous.

    Refused with :class:`plait.UnsupportedError` before anything is copied:
    meta tensors (no data), layouts other than strided (sparse: the sparse
    all_reduce takes CPU tensors), quantized tensors, lazily conjugated or
    negated views, and outputs whose memory overlaps itself (``expand()``),
    which ``copy_`` could not write into. A dtype numpy cannot hold is a
    TypeError, as on the CPU.

    Only the device check (``tensor.is_cpu``) is added to the CPU path: a
    CPU tensor is read over its own memory as before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from plait import _arrays
from plait._tensor import check_values
from plait.errors import UnsupportedError

__all__ = ["Staged", "check", "host_copy", "host_output", "then_write_back", "write_back"]

#: An output tensor off the CPU and the host array its call writes the results into.
Staged = tuple[torch.Tensor, np.ndarray]


def check(t: torch.Tensor, where: str, output: bool = False) -> None:
    """Refuse tensor ``t``, off the CPU, if it cannot be staged (Note [tensors on a GPU]).

    Raises:
        UnsupportedError: a meta tensor, a layout other than strided, a
            quantized tensor, a lazy conjugate or negation, or (``output``)
            memory that overlaps itself; the message, prefixed with
            ``where``, says why and what to call first.
    """
    if t.device.type == "meta":
        raise UnsupportedError(
            f"{where} is a tensor on meta, which has no data: the plait backend reads CPU "
            "tensors in place and copies tensors on other devices to the host, and a meta "
            "tensor has nothing to copy; pass a tensor with data"
        )
    if t.layout != torch.strided:
        raise UnsupportedError(
            f"{where} has layout {t.layout} on {t.device}; the plait backend stages dense "
            "(strided) tensors only: call .to_dense() first (a sparse all_reduce takes CPU "
            "tensors: .cpu())"
        )
    check_values(t, where, UnsupportedError)
    strides = zip(t.stride(), t.shape, strict=True)
    # an empty tensor has no memory to overlap
    if output and t.numel() and any(step == 0 and n > 1 for step, n in strides):
        raise UnsupportedError(
            f"{where} has overlapping memory (stride 0, as from expand()); results "
            "cannot be written into it: pass a tensor with its own memory (.clone())"
        )


def host_copy(t: torch.Tensor, where: str) -> np.ndarray:
    """Input tensor ``t``, off the CPU, as a host copy taken now.

    Raises:
        UnsupportedError: ``t`` cannot be staged (:func:`check`).
        TypeError: the copy failed, or a dtype numpy cannot hold.
    """
    check(t, where)
    return _arrays.to_host(t, where)


def host_output(t: torch.Tensor, where: str, back: list[Staged], contents: bool) -> np.ndarray:
    """A host buffer for output tensor ``t``, off the CPU, recorded in ``back``.

    ``contents``: the call reads what ``t`` holds too (all_reduce), so it is
    copied; otherwise the buffer is only allocated. The call writes into
    the buffer, and :func:`write_back` copies it into ``t`` once the call
    has succeeded.

    Raises:
        UnsupportedError: ``t`` cannot be staged or written into (:func:`check`).
        TypeError: the copy failed, or a dtype numpy cannot hold.
    """
    check(t, where, output=True)
    host = _arrays.host_buffer(t, where, contents)
    back.append((t, host))
    return host


def write_back(back: list[Staged]) -> None:
    """Copy every host buffer of ``back`` into its tensor, then synchronise each device once."""
    devices: dict[torch.device, torch.Tensor] = {}
    for t, host in back:
        _arrays.copy_back(t, host)
        devices.setdefault(t.device, t)
    for t in devices.values():
        _arrays.synchronize(t)


def then_write_back(finish: Callable[[], None] | None, back: list[Staged]) -> Callable[[], None]:
    """A work's finish step: ``finish`` (which fills the host buffers), then :func:`write_back`."""

    def finish_and_write_back() -> None:
        if finish is not None:
            finish()
        write_back(back)

    return finish_and_write_back
