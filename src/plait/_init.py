"""``plait.init``: make a Communicator from arguments or the environment."""

from __future__ import annotations

import os
from typing import Any

from plait.communicator import Communicator
from plait.errors import UnsupportedError
from plait.transport.base import Transport
from plait.transport.memory import MemoryFabric

__all__ = ["init"]


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def init(
    *,
    rank: int | None = None,
    size: int | None = None,
    store: Any = None,
    timeout: float | None = None,
    transport: Transport | None = None,
) -> Communicator:
    """Join the group of ranks and return this rank's :class:`Communicator`.

    Args:
        rank: this process's rank; default from the environment (PLAIT_RANK,
            RANK, OMPI_COMM_WORLD_RANK, SLURM_PROCID), else 0.
        size: number of ranks; default from the environment (PLAIT_SIZE,
            WORLD_SIZE, OMPI_COMM_WORLD_SIZE, SLURM_NTASKS), else 1.
        store: rendezvous store for multi-process runs.
        timeout: default seconds per call (PLAIT_TIMEOUT, else 300).
        transport: an already connected transport (e.g. an endpoint of
            :class:`plait.transport.memory.MemoryFabric`); rank and size come from it.

    With no arguments and no launcher environment, returns a single-rank
    communicator, as an MPI program started without mpirun does.
    """
    if transport is not None:
        if rank is not None and rank != transport.rank:
            raise ValueError(f"rank={rank} disagrees with the transport's rank {transport.rank}")
        if size is not None and size != transport.size:
            raise ValueError(f"size={size} disagrees with the transport's size {transport.size}")
        return Communicator(transport, timeout=timeout)
    if size is None:
        size = _env_int("PLAIT_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
    if rank is None:
        rank = _env_int("PLAIT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
    size = 1 if size is None else size
    rank = 0 if rank is None else rank
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
    if size == 1:
        return Communicator(MemoryFabric(1).endpoints[0], timeout=timeout)
    raise UnsupportedError(
        f"rank {rank} of {size}: multi-process communicators need a process transport; "
        "pass transport= (e.g. plait.testing.memory_communicators for threads)"
    )
