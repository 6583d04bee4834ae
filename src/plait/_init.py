"""``plait.init``: make a Communicator from arguments or the environment.

Note [how ranks find each other]
    Identity (rank, size, local rank) comes from the launcher's environment:
    ``plait run`` (PLAIT_*), torchrun (RANK, WORLD_SIZE, LOCAL_RANK, …),
    Open MPI's mpirun (OMPI_COMM_WORLD_*) or Slurm's srun (SLURM_*). The
    rendezvous store is, in order: ``store=``; PLAIT_STORE (a URL, set by
    ``plait run``); under torchrun, a plait TCP store that rank 0 serves on
    MASTER_ADDR at MASTER_PORT + 1 (MASTER_PORT itself belongs to torch's
    store); otherwise, when every rank is on one host (mpirun/srun without
    MASTER_ADDR), a file store in the temp directory keyed by the job's id.
    Ranks then publish their host names (PLAIT_HOST overrides the name, so
    several emulated hosts can share a machine), and the transport is chosen:
    shared memory when all ranks share a host, TCP otherwise (PLAIT_TRANSPORT
    or ``transport=`` force one).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

from plait.communicator import Communicator
from plait.errors import RendezvousError
from plait.rendezvous.store import PrefixStore, Store
from plait.transport.base import Transport
from plait.transport.memory import MemoryFabric

__all__ = ["LaunchInfo", "detect_launch", "init"]

TRANSPORTS = ("auto", "shm", "tcp")
_generation = 0
_generation_lock = threading.Lock()


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about this process's place in the job."""

    launcher: str  # "plait", "torchrun", "mpirun", "srun" or "none"
    rank: int
    size: int
    local_rank: int | None
    store_url: str | None
    store_is_server: bool
    job_id: str | None


def _env_int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def detect_launch(env: dict[str, str] | None = None) -> LaunchInfo:
    """Read rank, size and rendezvous from the environment of a known launcher."""
    env = dict(os.environ if env is None else env)
    url = env.get("PLAIT_STORE") or None
    if "PLAIT_RANK" in env:
        return LaunchInfo(
            "plait",
            _env_int(env, "PLAIT_RANK") or 0,
            _env_int(env, "PLAIT_SIZE") or 1,
            _env_int(env, "PLAIT_LOCAL_RANK"),
            url,
            False,
            env.get("PLAIT_JOB_ID"),
        )
    if "OMPI_COMM_WORLD_RANK" in env or ("SLURM_PROCID" in env and "RANK" not in env):
        mpi = "OMPI_COMM_WORLD_RANK" in env
        rank = _env_int(env, "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") or 0
        size = _env_int(env, "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS") or 1
        local = _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
        job = (
            env.get("PMIX_NAMESPACE")
            or env.get("OMPI_MCA_ess_base_jobid")
            or env.get("OMPI_MCA_orte_jobid")
            if mpi
            else f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
        )
        server = False
        if url is None and env.get("MASTER_ADDR"):
            port = _env_int(env, "MASTER_PORT") or 29500
            url = f"tcp://{_bracket(env['MASTER_ADDR'])}:{port + 1}"
            server = rank == 0
        if url is None and job:
            safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job)
            url = "file://" + os.path.join(tempfile.gettempdir(), f"plait-store-{safe}")
        return LaunchInfo("mpirun" if mpi else "srun", rank, size, local, url, server, job)
    if "RANK" in env and "WORLD_SIZE" in env:
        rank = _env_int(env, "RANK") or 0
        server = False
        if url is None and env.get("MASTER_ADDR"):
            port = _env_int(env, "MASTER_PORT") or 29500
            url = f"tcp://{_bracket(env['MASTER_ADDR'])}:{port + 1}"
            server = rank == 0
        return LaunchInfo(
            "torchrun",
            rank,
            _env_int(env, "WORLD_SIZE") or 1,
            _env_int(env, "LOCAL_RANK"),
            url,
            server,
            env.get("TORCHELASTIC_RUN_ID"),
        )
    return LaunchInfo("none", 0, 1, None, url, False, None)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def init(
    *,
    rank: int | None = None,
    size: int | None = None,
    store: Store | str | None = None,
    timeout: float | None = None,
    transport: Transport | str | None = None,
) -> Communicator:
    """Join the group of ranks and return this rank's :class:`Communicator`.

    Args:
        rank: this process's rank; default from the launcher's environment
            (see Note [how ranks find each other]), else 0.
        size: number of ranks; default from the environment, else 1.
        store: a :class:`~plait.rendezvous.store.Store` or a store URL
            (``tcp://host:port``, ``file:///path``, ``redis://host:port``).
        timeout: default seconds per call (PLAIT_TIMEOUT, else 300), also the
            rendezvous deadline.
        transport: ``"auto"`` (default), ``"shm"``, ``"tcp"``, or an already
            connected transport object (rank and size then come from it).

    With no arguments and no launcher environment, returns a single-rank
    communicator, as an MPI program started without mpirun does.

    Raises:
        RendezvousError: the other ranks could not be reached in time.
    """
    if transport is not None and not isinstance(transport, str):
        if rank is not None and rank != transport.rank:
            raise ValueError(f"rank={rank} disagrees with the transport's rank {transport.rank}")
        if size is not None and size != transport.size:
            raise ValueError(f"size={size} disagrees with the transport's size {transport.size}")
        return Communicator(transport, timeout=timeout)
    kind = (transport or os.environ.get("PLAIT_TRANSPORT") or "auto").lower()
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown transport {kind!r}; expected one of {', '.join(TRANSPORTS)}")
    info = detect_launch()
    rank = info.rank if rank is None else rank
    size = info.size if size is None else size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
    if timeout is None and os.environ.get("PLAIT_TIMEOUT"):
        timeout = float(os.environ["PLAIT_TIMEOUT"])
    if size == 1:
        return Communicator(MemoryFabric(1).endpoints[0], timeout=timeout)

    from plait.rendezvous.url import store_from_url

    owned = False
    if store is None:
        if info.store_url is None:
            raise RendezvousError(
                f"rank {rank} of {size}: cannot find the other ranks: start the job with "
                "`plait run`, or set PLAIT_STORE=tcp://host:port (or MASTER_ADDR/MASTER_PORT), "
                "or pass store="
            )
        store = info.store_url
    if isinstance(store, str):
        store = store_from_url(store, rank=rank, is_server=info.store_is_server, timeout=timeout)
        owned = True
    global _generation
    with _generation_lock:
        _generation += 1
        generation = _generation
    group = PrefixStore(f"plait/init{generation}", store)
    host = os.environ.get("PLAIT_HOST") or socket.gethostname()
    group.set(f"host/{rank}", host.encode())
    group.wait([f"host/{r}" for r in range(size)], timeout)
    hosts = [group.get(f"host/{r}").decode() for r in range(size)]
    if kind == "auto":
        kind = "shm" if len(set(hosts)) == 1 else "tcp"
    seconds = timeout if timeout is not None else 300.0
    t: Any
    if kind == "shm":
        if len(set(hosts)) != 1:
            raise RendezvousError(
                f"rank {rank}: the shared-memory transport needs all ranks on one host; "
                f"ranks are on {sorted(set(hosts))}"
            )
        from plait.transport.shm import ShmTransport

        t = ShmTransport(rank, size, PrefixStore("shm", group), timeout=seconds, job=info.job_id)
    else:
        from plait.transport.tcp import TcpTransport

        t = TcpTransport(rank, size, PrefixStore("tcp", group), timeout=seconds)
    comm = Communicator(t, timeout=timeout, hosts=hosts)
    if owned:
        comm._on_close.append(store.close)
    return comm
