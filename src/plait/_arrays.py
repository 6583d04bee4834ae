"""Arrays beyond numpy at the API edge: JAX arrays, and device arrays staged through the host.

:mod:`plait._checks` reads every array argument as a numpy array. numpy arrays,
torch CPU tensors (:mod:`plait._tensor`) and objects in CPU memory are read
over their own memory; this module adds the two kinds that cannot be:

- JAX arrays, which JAX never changes in place (Note [JAX arrays]);
- arrays in device memory (torch CUDA tensors, CuPy arrays, JAX arrays on a
  GPU, any DLPack exporter whose ``__dlpack_device__`` is not host memory),
  which plait copies to the host and back (Note [staging through the host]).

No library is imported here: an argument can only be a torch tensor, a JAX
array or a CuPy array if the caller has imported that library, so
``sys.modules`` decides, and a numpy argument pays nothing.

Note [JAX arrays]
    A ``jax.Array`` on the CPU is read through DLPack without a copy
    (``np.from_dlpack`` gives a read-only view of JAX's buffer; bfloat16,
    which DLPack cannot carry to numpy, through ``np.asarray``, also
    without a copy). A call that makes a new result returns it as a
    ``jax.Array`` (:func:`finisher`) once the call is done: on the CPU over
    the result's memory where JAX accepts it (``jax.dlpack.from_dlpack``),
    else copied by ``jax.device_put``. JAX arrays are immutable, so an
    argument plait would write into (``out=``, broadcast's ``x`` off root,
    recv's ``buf``) is refused with TypeError before any byte moves, like a
    list, as only a copy of it could be written; broadcast's root only reads
    its ``x``, so a JAX array is fine there, as a read-only numpy array is.

Note [staging through the host]
    An array in device memory is copied to the host (:func:`to_host`): its
    ``__dlpack__`` is asked for a CPU copy with ``stream=None``, the DLPack
    request that the producer make its pending work (on the legacy default
    stream, or on the stream it tracks) visible first, so the copy never
    reads a buffer a kernel is still writing; exporters older than DLPack
    1.0, which take no such keywords, are read through their own copy
    (``.get()``, then ``np.asarray``). torch tensors are copied with
    ``.cpu()``, which waits for the tensor's stream. The call runs on the
    host copy. Where it writes (``out=``, ``out=x``, broadcast's ``x``,
    recv's ``buf``) a :class:`DeviceTarget` copies the result back into
    the same device buffer once the call has succeeded, and waits for that
    copy to finish (:func:`synchronize`) before the call returns, so the
    caller may hand the buffer to any stream; a call that fails never
    writes back, so the caller's array keeps its contents. A new result
    comes back in the caller's type on the caller's device, also
    synchronised. Each staged argument costs a copy each way; that is the
    price of a host library, and the reason device arrays are not read
    "without a copy".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from plait import _tensor

__all__ = [
    "DeviceTarget",
    "copy_back",
    "finisher",
    "host_buffer",
    "immutable",
    "is_jax",
    "read",
    "staged",
    "synchronize",
    "target",
    "to_host",
    "write_back",
]

#: DLPack device types whose memory the CPU reads directly (numpy's from_dlpack takes them):
#: kDLCPU, kDLCUDAHost (pinned), kDLROCMHost, kDLCUDAManaged.
_HOST_DEVICES = frozenset((1, 3, 11, 13))
#: torch device types not staged: the CPU (read in place) and meta (no data: refused).
_NOT_STAGED = frozenset(("cpu", "meta"))
#: The DLPack device a CPU copy is asked for: (kDLCPU, 0).
_CPU = (1, 0)


def is_jax(x: Any) -> bool:
    """Whether ``x`` is a ``jax.Array``, without importing JAX."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, getattr(jax, "Array", ()))


def _cupy(x: Any) -> Any:
    """The cupy module when ``x`` is a CuPy array, else None."""
    cupy = sys.modules.get("cupy")
    return cupy if cupy is not None and isinstance(x, getattr(cupy, "ndarray", ())) else None


def staged(x: Any) -> bool:
    """Whether ``x`` lives in device memory, so that plait reads it through a host copy.

    A torch tensor off the CPU (not ``meta``, which has no data, refused by
    :func:`read`), a JAX array on a device other than the CPU, or any DLPack
    exporter whose ``__dlpack_device__`` is not host memory.
    """
    if _tensor.is_tensor(x):
        return x.device.type not in _NOT_STAGED
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        kind = int(device()[0])
    except Exception:
        return False
    return kind not in _HOST_DEVICES


def immutable(x: Any) -> bool:
    """Whether ``x`` is an array no call can write into: a JAX array (Note [JAX arrays]).

    A staged array without ``__setitem__`` counts too: its result could not
    be copied back.
    """
    return is_jax(x) or (
        not _tensor.is_tensor(x) and staged(x) and not hasattr(type(x), "__setitem__")
    )


def read(x: Any, where: str) -> np.ndarray:
    """A torch tensor, a JAX array or another DLPack object as a numpy array.

    In CPU memory: the same memory, no copy (read-only for JAX). In device
    memory: a host copy (Note [staging through the host]), which may be
    read-only.

    Raises:
        TypeError: a meta tensor (no data), an array that cannot be read
            or staged (the message, prefixed with ``where``, says why), or a
            dtype numpy cannot hold.
    """
    if staged(x):
        return to_host(x, where)
    if _tensor.is_tensor(x):
        return _tensor.as_array(x, where)  # which refuses a meta tensor
    try:
        return np.from_dlpack(x)
    except (TypeError, RuntimeError, BufferError, ValueError) as exc:
        if is_jax(x):  # bfloat16 and the like, which DLPack cannot hand numpy: JAX's own view
            jax_view: np.ndarray = np.asarray(x)
            return jax_view
        raise TypeError(
            f"{where} ({type(x).__name__}) cannot be read without a copy: {exc}; pass an array "
            "in CPU memory, such as a numpy array"
        ) from None


def to_host(x: Any, where: str) -> np.ndarray:
    """A host copy of device array ``x``, once the producer's pending work is done.

    See Note [staging through the host] for the order tried: torch's
    ``.cpu()``; DLPack with ``dl_device=CPU, copy=True, stream=None``;
    then, for exporters that do not take those keywords, ``.get()`` (CuPy)
    and ``np.asarray``.

    Raises:
        TypeError: nothing could copy it; the message says what each try said.
    """
    if _tensor.is_tensor(x):
        try:
            return _tensor.as_array(x.detach().cpu(), where)
        except RuntimeError as exc:
            raise TypeError(f"{where} cannot be copied to the host: {exc}") from None
    errors: list[str] = []
    dlpack = getattr(x, "__dlpack__", None)
    if dlpack is not None:
        try:
            capsule = dlpack(stream=None, dl_device=_CPU, copy=True, max_version=(1, 0))
            return np.from_dlpack(_Capsule(capsule))
        except (TypeError, RuntimeError, BufferError, ValueError, NotImplementedError) as exc:
            errors.append(f"__dlpack__(dl_device=CPU, copy=True): {exc}")
    get = getattr(x, "get", None)
    if _cupy(x) is not None and callable(get):
        host: np.ndarray = get()
        return host
    try:
        a = np.asarray(x)
        if a.dtype.kind != "O":
            return a
        errors.append("np.asarray gives an object array")
    except Exception as exc:
        errors.append(f"np.asarray: {exc}")
    raise TypeError(
        f"{where} ({type(x).__name__}) is in device memory and cannot be staged through the "
        f"host: {'; '.join(errors)}; pass a numpy array or an array in CPU memory"
    )


class _Capsule:
    """A DLPack capsule already made, handed to ``np.from_dlpack`` (which wants an object)."""

    __slots__ = ("_capsule",)

    def __init__(self, capsule: Any) -> None:
        self._capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return _CPU


def host_buffer(x: Any, where: str, contents: bool) -> np.ndarray:
    """A writeable, contiguous host array for staged ``x`` to be written back from.

    ``contents``: the call reads what ``x`` holds too (broadcast's root,
    ``out=x``), so it is copied; otherwise only the shape and dtype matter,
    and where ``x`` states them (``shape``, a numpy ``dtype``) nothing is
    copied from the device.
    """
    if not contents and _tensor.is_tensor(x):
        import torch

        return _tensor.as_array(torch.empty(tuple(x.shape), dtype=x.dtype), where)
    if not contents:
        try:
            return np.empty(tuple(x.shape), np.dtype(x.dtype))
        except (AttributeError, TypeError):
            pass
    host = read(x, where)
    if host.flags.writeable and host.flags.c_contiguous:
        return host
    return np.array(host, order="C")


def write_back(x: Any, host: np.ndarray) -> None:
    """Copy ``host`` into device array ``x``'s own buffer, then wait until it is there."""
    copy_back(x, host)
    synchronize(x)


def copy_back(x: Any, host: np.ndarray) -> None:
    """Copy ``host`` into device array ``x``'s own buffer, without waiting for the copy.

    :func:`write_back` waits; a caller that writes several arrays back (the
    torch backend's output lists) copies them all first and synchronises
    each device once.
    """
    if _tensor.is_tensor(x):
        x.detach().copy_(_tensor.like(x, np.ascontiguousarray(host)).reshape(x.shape))
    else:
        cupy = _cupy(x)
        if cupy is not None and x.flags.c_contiguous:
            x.set(host)
        elif cupy is not None:
            x[...] = cupy.asarray(host)
        else:
            space = getattr(x, "__array_namespace__", None)
            x[...] = space().asarray(host, device=x.device) if space is not None else host


def synchronize(x: Any) -> None:
    """Wait until the work queued on device array ``x``'s device has finished.

    torch: its device module's ``synchronize`` (``torch.cuda.synchronize``);
    JAX: ``block_until_ready``; others: ``x.device.synchronize()`` where the
    device has one (CuPy's ``Device``).
    """
    if _tensor.is_tensor(x):
        import torch

        module = getattr(torch, x.device.type, None)
        sync = getattr(module, "synchronize", None)
        if sync is not None and x.device.type in ("cuda", "xpu"):
            sync(x.device)
        elif sync is not None:
            sync()
        return
    if is_jax(x):
        x.block_until_ready()
        return
    sync = getattr(getattr(x, "device", None), "synchronize", None)
    if callable(sync):
        sync()


class DeviceTarget:
    """Where a staged call's result goes: the caller's device array, once the call succeeds.

    It stands where a call keeps the caller's memory to write back into
    (``Request.writeback``, a receive's array), with the two things used
    there: ``shape`` and ``target[...] = result``.
    """

    __slots__ = ("obj", "shape")

    def __init__(self, obj: Any, shape: tuple[int, ...]) -> None:
        self.obj = obj
        self.shape = shape

    def __setitem__(self, key: Any, value: np.ndarray) -> None:
        write_back(self.obj, np.asarray(value).reshape(self.shape))


def target(dst: Any, host: np.ndarray) -> DeviceTarget | None:
    """A :class:`DeviceTarget` when ``dst``, the caller's object, is staged, else None."""
    if isinstance(dst, np.ndarray) or not staged(dst):
        return None
    return DeviceTarget(dst, host.shape)


def finisher(src: Any) -> Callable[[Any], Any] | None:
    """What turns a fresh host result into ``src``'s type and device; None to keep it.

    None for everything whose result plait already makes before the call (a
    numpy array; a torch CPU tensor over the result's memory) or has no type
    to give back (lists, buffers). Otherwise a function of the host result,
    run once the call has succeeded (the result's contents exist only then).
    """
    if is_jax(src):
        return lambda new: _jax_result(src, new)
    if not staged(src):
        return None
    if _tensor.is_tensor(src):
        return lambda new: _on_device(src, _tensor.like(src, new).to(src.device))
    cupy = _cupy(src)
    if cupy is not None:

        def to_cupy(new: np.ndarray) -> Any:
            with src.device:
                return _on_device(src, cupy.asarray(new))

        return to_cupy
    space = getattr(src, "__array_namespace__", None)
    if space is None:
        return None  # a library plait cannot build arrays of: the host result, as numpy
    return lambda new: _on_device(src, space().asarray(new, device=src.device))


def _on_device(src: Any, result: Any) -> Any:
    """``result``, a new array on ``src``'s device, once its copy there has finished."""
    synchronize(src)
    return result


def _jax_result(src: Any, new: np.ndarray) -> Any:
    """Host result ``new`` as a ``jax.Array`` where ``src`` is: no copy on the CPU where JAX can."""
    import jax

    devices = src.devices()
    where = next(iter(devices)) if len(devices) == 1 else None
    if where is not None and where.platform == "cpu":
        try:
            res = jax.dlpack.from_dlpack(new)
        except (TypeError, BufferError, RuntimeError, ValueError):
            res = None  # bfloat16 and other dtypes DLPack lacks
        if res is not None and res.devices() == devices:
            return res
    placement = where if where is not None else src.sharding if new.shape == src.shape else None
    return jax.device_put(new, placement).block_until_ready()
