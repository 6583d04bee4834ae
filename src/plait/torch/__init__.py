"""plait as a torch.distributed backend, for CPU tensors and CUDA tensors staged through the host.

::

    import torch.distributed as dist
    import plait.torch  # registers the "plait" backend

    dist.init_process_group("plait")  # env:// under torchrun or plait run, or store=/init_method=
    dist.all_reduce(tensor)
    model = torch.nn.parallel.DistributedDataParallel(model)
    objs = plait.torch.communicator().allgather_object(obj)  # plait's object collectives
    plait.torch.monitored_barrier(timeout=timedelta(seconds=30))  # names ranks that are late

Importing this module registers the backend with
``torch.distributed.Backend.register_backend("plait", ..., extended_api=True,
devices=["cpu", "cuda"])`` (CUDA tensors go through host copies, see
``plait.torch._staging``), lets ``env://`` work under ``plait run`` (see
``plait.torch._store``) and, unless PLAIT_TORCH_OBJECTS=0 (a value other than
0/1, false/true, no/yes, off/on is refused with ValueError), has
``dist.all_gather_object`` and the other ``*_object`` functions run plait's
object collectives on "plait" groups (see ``plait.torch._objects``).
``import plait`` alone never imports torch. See docs/torch.md for what is supported and the limits.
"""

from __future__ import annotations

try:
    import torch.distributed as _dist
except ImportError as _exc:  # pragma: no cover - exercised only without torch
    raise ImportError(
        "plait.torch needs PyTorch with torch.distributed: pip install 'plait[torch]'"
    ) from _exc
if not _dist.is_available():  # pragma: no cover - torch built without distributed
    raise ImportError("plait.torch needs a PyTorch build with torch.distributed")

from plait.torch._backend import BACKEND_NAME as BACKEND_NAME
from plait.torch._backend import DEVICE_TYPES as _DEVICE_TYPES
from plait.torch._backend import ProcessGroupPlait as ProcessGroupPlait
from plait.torch._convert import OPS as OPS
from plait.torch._group import communicator as communicator
from plait.torch._group import create_process_group as create_process_group
from plait.torch._group import monitored_barrier as monitored_barrier
from plait.torch._objects import enabled as _objects_enabled
from plait.torch._objects import install as _install_objects
from plait.torch._store import TorchStore as TorchStore
from plait.torch._store import install_env_rendezvous as _install_env_rendezvous
from plait.torch._work import PlaitWork as PlaitWork

__all__ = [
    "BACKEND_NAME",
    "OPS",
    "PlaitWork",
    "ProcessGroupPlait",
    "TorchStore",
    "communicator",
    "create_process_group",
    "monitored_barrier",
    "register",
]


def register() -> None:
    """Register the "plait" backend with torch.distributed (done on import; idempotent).

    Also wraps torch's ``*_object`` functions for plait groups unless
    PLAIT_TORCH_OBJECTS is 0/false/no/off (``plait.torch._objects``).

    Raises:
        ValueError: PLAIT_TORCH_OBJECTS is set to anything else but 1/true/yes/on (any
            case); nothing is registered then.
    """
    objects = _objects_enabled()  # before anything changes in torch
    if BACKEND_NAME not in _dist.Backend.backend_list:
        _dist.Backend.register_backend(
            BACKEND_NAME, create_process_group, extended_api=True, devices=list(_DEVICE_TYPES)
        )
    _install_env_rendezvous()
    if objects:
        _install_objects()


register()
