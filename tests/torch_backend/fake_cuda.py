"""CUDA tensors without a GPU: what the torch backend's staging through the host is tested with.

:class:`FakeCudaTensor` is a CPU tensor that says it lives on ``cuda:N``
(``device``, ``is_cpu``, ``is_cuda``) and behaves as a CUDA tensor does where
the plait backend could tell the difference (the counterpart of
``tests/fake_device.py``'s device array, for torch):

- numpy cannot read it (``numpy()`` raises torch's own error for a CUDA
  tensor), so the backend can only reach its contents through ``.cpu()``,
  which returns a plain CPU copy after the work queued on the device
  (:meth:`FakeCudaTensor.launch`, a kernel still writing) has run, as a real
  ``.cpu()`` waits for the tensor's stream;
- ``copy_`` into it is queued on the device, as a host-to-device copy is,
  and lands in its memory only when the device is synchronised
  (:meth:`FakeCuda.synchronize`, installed as ``torch.cuda.synchronize`` by
  :meth:`FakeCuda.install`). A backend that skips the write-back, or returns
  without synchronising, leaves the old contents where the test looks
  (:meth:`FakeCudaTensor.held`).

Every request is counted on its :class:`FakeGpu`: ``reads`` (host copies),
``writes`` (``copy_`` calls; a tensor's own in :attr:`FakeCudaTensor.writes`),
``syncs``; ``synced_writes`` is how many writes had landed at each
synchronisation.

``__torch_function__`` is switched off for the subclass, so torch's own Python
functions (``dist.all_reduce`` and the rest) take these tensors as plain
tensors and hand them to the process group unchanged; only the attributes and
methods defined here differ from a CPU tensor's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import pytest


class FakeGpu:
    """One pretend GPU: its queue of copies runs only on :meth:`synchronize`."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.reads = 0
        self.writes = 0
        self.written: list[int] = []  # the data_ptr of each write's destination
        # The memory of every tensor written, kept for the GPU's life: a tensor made later
        # at a freed written address would otherwise count that write as its own.
        self._kept: list[torch.Tensor] = []
        self.syncs = 0
        self.synced_writes: list[int] = []
        self._queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # (memory, new values)

    def tensor(self, values: Any, dtype: torch.dtype | None = None) -> FakeCudaTensor:
        """A new tensor "on" this GPU holding ``values``."""
        return FakeCudaTensor(torch.as_tensor(values, dtype=dtype).clone(), self)

    def synchronize(self) -> None:
        """Run everything queued on the device (``torch.cuda.synchronize(device)``)."""
        self.syncs += 1
        self._run_queue()
        self.synced_writes.append(self.writes)

    def _queue_write(self, memory: torch.Tensor, values: torch.Tensor) -> None:
        self._queue.append((memory, values))

    def _run_queue(self) -> None:
        for memory, values in self._queue:
            memory.copy_(values)
        self._queue.clear()


class FakeCuda:
    """The pretend GPUs of a test, and ``torch.cuda.synchronize`` over them."""

    def __init__(self, count: int = 1) -> None:
        self.gpus = [FakeGpu(i) for i in range(count)]

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        """Put :meth:`patches` in ``torch.cuda`` for the test's duration."""
        for name, fn in self.patches().items():
            monkeypatch.setattr(torch.cuda, name, fn)
        return self

    def patches(self) -> dict[str, Any]:
        """What ``torch.cuda`` needs for these GPUs: ``synchronize``, and the
        ``get_device_capability`` that ``dist.broadcast`` asks of a CUDA tensor's device
        (an A100's, 8.0); outside pytest, ``setattr(torch.cuda, name, fn)`` for each."""
        return {"synchronize": self.synchronize, "get_device_capability": self.capability}

    def capability(self, device: Any = None) -> tuple[int, int]:
        """``torch.cuda.get_device_capability``: every fake GPU is an sm80."""
        return (8, 0)

    def synchronize(self, device: Any = None) -> None:
        """``torch.cuda.synchronize``: the GPU ``device`` names (an index, a device, None: 0)."""
        if device is None:
            index = 0
        elif isinstance(device, int):
            index = device
        else:
            index = torch.device(device).index or 0
        self.gpus[index].synchronize()


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:N``; see the module's docstring."""

    gpu: FakeGpu
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, memory: torch.Tensor, gpu: FakeGpu) -> FakeCudaTensor:
        t = torch.Tensor._make_subclass(cls, memory)  # the same memory, not a copy
        t.gpu = gpu
        return t

    # -- the test's side ---------------------------------------------------------------
    def launch(self, values: Any) -> None:
        """Queue new contents, as a kernel still running on the device would write them."""
        new = torch.as_tensor(values, dtype=self.dtype).reshape(self.shape)
        self.gpu._queue_write(self._memory(), new)

    def held(self) -> torch.Tensor:
        """A CPU copy of what the device memory holds now (queued work not included)."""
        return self._memory().clone()

    @property
    def writes(self) -> int:
        """How many copies into this tensor's memory were made (queued or landed)."""
        return self.gpu.written.count(self.data_ptr())

    def _memory(self) -> torch.Tensor:
        return torch.Tensor.detach(self)  # a plain tensor over the same memory

    # -- what the backend sees -----------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.gpu.index)

    @property
    def is_cpu(self) -> bool:
        return False

    @property
    def is_cuda(self) -> bool:
        return True

    def detach(self) -> FakeCudaTensor:
        return FakeCudaTensor(self._memory(), self.gpu)

    def cpu(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """A host copy, once the work queued before it has run (a real ``.cpu()`` waits)."""
        self.gpu._run_queue()
        self.gpu.reads += 1
        return self._memory().clone()

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> FakeCudaTensor:
        """A copy from the host, queued: it lands on the device's next synchronize."""
        assert not isinstance(src, FakeCudaTensor), "device-to-device copies are not faked"
        self.gpu._queue_write(self._memory(), src.detach().clone())
        self.gpu.writes += 1
        self.gpu.written.append(self.data_ptr())
        self.gpu._kept.append(self._memory())
        return self

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to "
            "copy the tensor to host memory first."
        )
