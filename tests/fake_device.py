"""A device array without a device: what plait's staging through the host is tested with.

:class:`FakeDeviceArray` says it lives on a CUDA device (``__dlpack_device__``)
and behaves as a device array does where plait can tell the difference:

- its memory is not the host's: ``__dlpack__`` serves only host copies
  (``dl_device=(kDLCPU, 0)`` with ``copy=True``), and it has no ``__array__``
  or buffer protocol;
- work on it is asynchronous: :meth:`launch` queues new contents as a kernel
  would, and a host copy sees them only if the consumer asked the producer to
  synchronise (passed ``stream=``); a copy taken without asking gets the old
  contents, so a staging that forgets to ask computes on stale data;
- writes into it (``x[...] = host``) are queued on the stream too, and land
  in its memory only when its device is synchronised
  (:meth:`FakeDevice.synchronize`), so a staging that returns without
  synchronising leaves the old contents where the test looks.

Every request is recorded: ``streams`` (the ``stream=`` of each copy),
``unsynced_reads``, ``writes`` and the device's ``syncs``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: DLPack device types: the host, and the CUDA device this fake claims.
KDL_CPU = 1
KDL_CUDA = 2

#: What a consumer that passes no ``stream=`` gets (torch's default: no synchronisation).
_NO_STREAM: Any = object()


class FakeDevice:
    """A device whose queued work completes only on :meth:`synchronize`."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.syncs = 0
        self.arrays: list[FakeDeviceArray] = []

    def synchronize(self) -> None:
        """Finish everything queued on the device (CuPy's ``Device.synchronize``)."""
        self.syncs += 1
        for a in self.arrays:
            a._complete()


class FakeDeviceArray:
    """An array in (pretended) device memory; see the module's docstring."""

    def __init__(self, values: Any, device: FakeDevice) -> None:
        self._memory = np.array(values)  # what the device holds now
        self._queued: np.ndarray | None = None  # contents a kernel or a copy is still writing
        self.device = device
        self.streams: list[Any] = []
        self.unsynced_reads = 0
        self.writes = 0
        device.arrays.append(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._memory.shape)

    @property
    def dtype(self) -> np.dtype:
        return self._memory.dtype

    # -- the test's side ---------------------------------------------------------------
    def launch(self, values: Any) -> None:
        """Queue new contents, as a kernel still running on the device's stream would."""
        self._queued = np.array(values, self._memory.dtype).reshape(self._memory.shape)

    def held(self) -> np.ndarray:
        """A copy of what the device memory holds now (queued work not included)."""
        return self._memory.copy()

    # -- what plait sees ----------------------------------------------------------------
    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device.index)

    def __dlpack__(
        self,
        *,
        stream: Any = _NO_STREAM,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        if dl_device is None or tuple(dl_device) != (KDL_CPU, 0) or copy is not True:
            raise BufferError(
                "FakeDeviceArray is in device memory: it serves host copies only "
                "(dl_device=(kDLCPU, 0), copy=True)"
            )
        if stream is _NO_STREAM:
            self.unsynced_reads += 1  # the copy races the queued work: it sees the old data
        else:
            self.streams.append(stream)
            self._complete()
        return self._memory.copy().__dlpack__(max_version=max_version)

    def __setitem__(self, key: Any, value: Any) -> None:
        """A copy from the host, queued on the stream: it lands on the next synchronize."""
        if isinstance(value, FakeDeviceArray):
            value = value._queued if value._queued is not None else value._memory
        staged = self._memory.copy()
        staged[key] = value
        self._queued = staged
        self.writes += 1

    def __array_namespace__(self) -> FakeNamespace:
        return FakeNamespace()

    def _complete(self) -> None:
        if self._queued is not None:
            self._memory, self._queued = self._queued, None


class FakeNamespace:
    """The array-API namespace of :class:`FakeDeviceArray`: only ``asarray`` onto a device."""

    def asarray(self, values: Any, *, device: FakeDevice) -> FakeDeviceArray:
        """A new device array whose copy from the host is queued (done on synchronize)."""
        host = np.asarray(values)
        new = FakeDeviceArray(np.zeros_like(host), device)
        new._queued = host.copy()
        return new


class Unstageable:
    """A device array that serves no host copy at all (nor ``__array__``)."""

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, 0)

    def __dlpack__(self, **kwargs: Any) -> Any:
        raise BufferError("this exporter cannot copy to the host")
