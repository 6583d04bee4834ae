"""plait as a Ray collective backend: ``ray.util.collective`` groups with ``backend="plait"``.

``import plait.ray`` registers the backend with Ray's registry of collective
backends (``ray.util.collective.backend_registry``) in the importing process.
Ray creates a group's object in each member actor, so every actor process
must have imported ``plait.ray`` before its first collective call: import it
at the top of the actor's module or in its ``__init__``, or have every worker
import it at start-up with ``ray.init(runtime_env={"worker_process_setup_hook":
"plait.ray.register"})``. Then::

    import ray.util.collective as col

    col.init_collective_group(world_size, rank, backend="plait", group_name="g")
    col.allreduce(x, group_name="g")                  # in place, numpy or CPU torch
    plait.ray.communicator("g").alltoall(y)           # what Ray lacks

``plait.ray.train`` runs Ray Train's ``TorchTrainer`` on the plait torch
backend. See docs/ray.md.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import plait
from plait.ray._rendezvous import group_namespace, job_namespace
from plait.ray._store import RayKeyValue, RayKVStore

if TYPE_CHECKING:
    from plait.ray._group import PlaitGroup

__all__ = [
    "BACKEND_NAME",
    "PlaitGroup",
    "RayKVStore",
    "RayKeyValue",
    "communicator",
    "group_namespace",
    "job_namespace",
    "register",
]

#: The backend's name for ``backend=`` (Ray upper-cases it: ``"PLAIT"``).
BACKEND_NAME = "plait"
_MISSING_RAY = "plait.ray needs Ray: pip install 'plait[ray]'"


def register() -> None:
    """Register the ``"plait"`` backend with Ray in this process (again: nothing happens).

    Usable as Ray's ``worker_process_setup_hook`` (``"plait.ray.register"``).

    Raises:
        ImportError: Ray is not installed.
        ValueError: another class is registered under the name.
    """
    try:
        import ray.util.collective  # noqa: F401 - registers Ray's own backends first
        from ray.util.collective.backend_registry import (
            _global_registry,
            register_collective_backend,
        )
    except ImportError as exc:
        raise ImportError(_MISSING_RAY) from exc
    from plait.ray._group import PlaitGroup

    if _global_registry.is_registered(BACKEND_NAME):
        if _global_registry.get(BACKEND_NAME) is not PlaitGroup:
            raise ValueError(
                f"another class is registered with Ray as backend {BACKEND_NAME!r}: "
                f"{_global_registry.get(BACKEND_NAME)!r}"
            )
        return
    register_collective_backend(BACKEND_NAME, PlaitGroup)


def communicator(group_name: str = "default") -> plait.Communicator:
    """This actor's plait communicator of the Ray group ``group_name`` (created if declared).

    For the collectives Ray lacks (gather, scatter, alltoall, the object
    collectives, split, …), on the same connections as the group's calls.

    Raises:
        TypeError: the group's backend is not plait.
        RuntimeError: this process is not in the group (Ray's error).
    """
    from ray.util.collective.collective import get_group_handle

    from plait.ray._group import PlaitGroup

    group = get_group_handle(group_name)
    if not isinstance(group, PlaitGroup):
        raise TypeError(
            f"Ray group {group_name!r} runs on backend {type(group).__name__}, not plait"
        )
    return group.communicator


def __getattr__(name: str) -> Any:
    if name == "PlaitGroup":
        from plait.ray._group import PlaitGroup

        return PlaitGroup
    raise AttributeError(f"module 'plait.ray' has no attribute {name!r}")


# Without Ray the key-value adapter still imports (and is tested); register() then says why.
with contextlib.suppress(ImportError):
    register()
