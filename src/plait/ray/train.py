"""Ray Train's ``TorchTrainer`` on the plait torch backend: ``torch_config=PlaitTorchConfig()``.

Ray Train creates the torch process group itself, in each worker, with the
backend named by ``TorchConfig(backend=...)``: ``dist.init_process_group(
backend, init_method="env://", ...)`` after setting MASTER_ADDR and
MASTER_PORT. ``TorchConfig(backend="plait")`` alone fails there, since torch
knows the name ``"plait"`` only in processes that imported :mod:`plait.torch`,
and Ray Train's workers are fresh processes. :class:`PlaitTorchConfig` is
that config with one step more: before the process group is created, every
worker imports :mod:`plait.torch`. The plait backend then meets through
torch's own store at MASTER_ADDR:MASTER_PORT, as under torchrun; DDP,
``prepare_model`` and the rest of Ray Train run unchanged.

(The alternative, without this module: ``TorchConfig(backend="plait")`` with
``ray.init(runtime_env={"worker_process_setup_hook": "plait.torch.register"})``
or any other way of importing :mod:`plait.torch` in every worker at start-up.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

__all__ = ["PlaitTorchConfig"]


def _import_plait_torch() -> None:
    """Run in each worker: registers the ``"plait"`` backend with torch.distributed."""
    import plait.torch  # noqa: F401


class _PlaitTorchBackend(_TorchBackend):  # type: ignore[misc]  # Ray's classes are Any to mypy
    """Ray Train's torch backend, importing plait.torch in every worker first."""

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        worker_group.execute(_import_plait_torch)
        super().on_start(worker_group, backend_config)


@dataclass
class PlaitTorchConfig(TorchConfig):  # type: ignore[misc]
    """``TorchConfig`` with ``backend="plait"`` that also makes the workers import plait.torch.

    Args (as ``TorchConfig``'s):
        backend: ``"plait"``, which serves CPU and CUDA tensors (CUDA ones staged
            through the host, docs/torch.md); torch 2.13 takes a Python backend only
            whole, so a per-device string such as ``"cpu:plait,cuda:nccl"`` is refused.
        init_method: ``"env"`` (default) or ``"tcp"``.
        timeout_s: seconds for process-group operations.
    """

    backend: str | None = "plait"

    @property
    def backend_cls(self) -> type:
        """The backend Ray Train runs: its own, with the import step first."""
        return _PlaitTorchBackend
