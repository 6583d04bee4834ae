"""``plait.init``: make a Communicator from arguments or the environment.

Note [how ranks find each other]
    Identity (rank, size, local rank) comes from the launcher's environment.
    Launchers nest (torchrun started by srun, a script under mpirun that
    copies OMPI_COMM_WORLD_RANK into RANK), so the innermost one wins:

    1. ``plait run``: PLAIT_RANK, PLAIT_SIZE, PLAIT_LOCAL_RANK, PLAIT_LOCAL_SIZE.
    2. torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, with
       TORCHELASTIC_RUN_ID (set by torchrun only).
    3. Open MPI's mpirun (4 and 5): OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,
       _LOCAL_SIZE; the job id is PMIX_NAMESPACE (a number such as
       ``2048196609`` in Open MPI 4, ``prterun-host-1234@1`` in 5; older
       versions: OMPI_MCA_ess_base_jobid). Else Slurm's srun: SLURM_PROCID,
       SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), SLURM_LOCALID; the job id
       is ``SLURM_JOB_ID.SLURM_STEP_ID`` (plus ``.rN`` after N requeues).
       Only a task of a step counts: a batch script itself has SLURM_PROCID=0
       and SLURM_NTASKS=N but no SLURM_STEP_ID, and is a lone process.
       If RANK and WORLD_SIZE are set too and disagree with these, they win
       (whatever set them per process runs inside mpirun or srun).
    4. RANK and WORLD_SIZE alone: torch's ``env://`` convention, whoever set them.

    The rendezvous store is, in order: ``store=``; PLAIT_STORE (a URL, set by
    ``plait run``); if MASTER_ADDR is set, a plait TCP store that rank 0 serves
    on MASTER_ADDR at MASTER_PORT + 1 (MASTER_PORT, default 29500, belongs to
    torch's own store; the next port must be free); otherwise, under mpirun or
    srun with every rank on one host, a file store in a private directory of
    the temp dir named after the user and the job id (``plait-0-4242.0-<n>``
    for the n-th ``init`` of the process in step 0 of Slurm job 4242, as
    root); under srun on several nodes, a plait TCP store that rank 0 serves
    on the first node of SLURM_STEP_NODELIST (where Slurm puts task 0), at
    MASTER_PORT + 1 or else a port in 20000..29999 derived from the job and
    step ids. Ranks on several hosts with none of these (mpirun across hosts
    without MASTER_ADDR) cannot meet: ``init`` says so.
    Ranks then publish their host names (PLAIT_HOST overrides the name, so
    several emulated hosts can share a machine), and the transport is chosen
    per peer pair: shared memory when all ranks share a host, TCP when no two
    do, and otherwise the hybrid transport (shared memory to the ranks on the
    same host, TCP to the others). PLAIT_TRANSPORT or ``transport=`` force
    one: ``shm`` (one host only), ``tcp`` (every pair over TCP) or ``hybrid``.

Note [store lifetime]
    The ranks meet through the store; after that, only recovery uses it
    (``abort``, ``agree``, ``shrink``: :mod:`plait._recovery`). So the
    communicator keeps the store open, and a watcher thread per rank waits
    there for aborts and keeps the rank's heartbeat; the store is let go when
    the communicator (or the last one shrunk from it) closes, or is dropped
    unreferenced (Note [dropped communicators] in plait._recovery). With
    ``PLAIT_RECOVERY=0`` it is let go before ``init`` returns, no thread is
    started, ``abort`` is local only and ``agree`` and ``shrink`` refuse.
    Letting go of a store ``init`` opened itself (from a URL or the
    environment) means closing it, and:

    - The temp-dir file store is deleted by the last rank to be done with it:
      each rank adds itself to the key ``left``, and the one that makes the
      count reach ``size`` removes the directory. A rank that fails counts
      itself out too, one that times out waiting for ranks that never came
      counts them out (Note [ranks that never came] in plait._meeting), and
      ``shrink`` counts out the ranks it leaves behind; only a rank killed
      after it joined ``init``, before ``shrink`` learns of it, leaves its
      job's directory behind (a few bytes, never reused: the name holds the
      job id).
      Every ``init`` in a process gets a directory of its own, since the last
      rank of one ``init`` may delete its directory while faster ranks have
      moved on to the next.
    - The MASTER_PORT + 1 server lives as long as rank 0's process, and every
      ``init`` there uses it (its keys are per ``init``). Shutting it down at
      the end of an ``init`` would race with the next one: the other ranks
      would reach the old server, not yet closed, and lose what they wrote.
      torch's store on MASTER_PORT lives as long, too.

    The temp-dir file store (mpirun or srun on one host, without MASTER_ADDR
    or PLAIT_STORE) is let go before ``init`` returns, as with
    ``PLAIT_RECOVERY=0``: were it kept, a rank killed later could not count
    itself out, and the job's directory would stay in the temp dir for good.
    Set PLAIT_STORE (or MASTER_ADDR) there for ``agree`` and ``shrink``.

    A store passed as an object is the caller's and left alone: no watcher
    thread runs on it (it may be shared, as torch's is in the torch backend,
    whose client a thread waiting there would hold up), so its communicator
    has a local-only ``abort`` and no ``agree`` or ``shrink``, as with
    ``PLAIT_RECOVERY=0``.

"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
import tempfile
import threading
import time
import urllib.parse
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plait._binding import bind_crowded
from plait._checks import check_timeout, env_switch
from plait._meeting import (
    TRANSPORTS,
    check_arguments,
    claim_rank,
    init_space,
    job_space,
    leave,
    meet,
    world_made,
)
from plait._processes import die_with_launcher, host_name
from plait.communicator import Communicator, default_timeout
from plait.errors import CommError, RendezvousError
from plait.group import own_comm_id
from plait.rendezvous.lost import JobRanks, report_gave_up
from plait.rendezvous.store import PrefixStore, Store
from plait.selection.select import fingerprint, settings
from plait.transport.base import Transport
from plait.transport.memory import MemoryFabric

__all__ = ["TRANSPORTS", "LaunchInfo", "detect_launch", "init"]

#: MASTER_PORT when MASTER_ADDR is set without it (torchrun's default).
DEFAULT_MASTER_PORT = 29500
_generation = 0
_generation_lock = threading.Lock()
#: Store servers rank 0 runs at MASTER_PORT + 1, by (host, port); see Note [store lifetime].
_servers: dict[tuple[str, int], Any] = {}
_servers_lock = threading.Lock()


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about this process's place in the job.

    Attributes:
        launcher: ``"plait"``, ``"torchrun"`` (torchrun, or RANK and WORLD_SIZE
            set by anyone), ``"mpirun"``, ``"srun"`` or ``"none"``.
        rank, size: this process's rank and the number of ranks.
        local_rank: rank among the ranks on this host, if the launcher says.
        store_url: where the ranks meet (see Note [how ranks find each other]),
            or None when the environment does not tell.
        store_is_server: this process serves the ``tcp://`` store (rank 0, with
            MASTER_ADDR).
        job_id: the job's id, if any: PLAIT_JOB_ID where set, else the launcher's.
        local_size: ranks on this host, if the launcher says.
        store_is_temp: ``store_url`` is a directory plait names in the temp dir;
            :func:`init` appends ``-<n>`` for its n-th call and deletes the
            directory once every rank has met (Note [store lifetime]).
        store_by_rank0: ``store_url`` is the store rank 0 serves at
            MASTER_PORT + 1 (``store_is_server`` says whether this is rank 0).
    """

    launcher: str
    rank: int
    size: int
    local_rank: int | None
    store_url: str | None
    store_is_server: bool
    job_id: str | None
    local_size: int | None = None
    store_is_temp: bool = False
    store_by_rank0: bool = False


def _given(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip() != ""


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    """The first of ``names`` that is set, as an int (None if none is set)."""
    for name in names:
        value = env.get(name, "")
        if value.strip() != "":
            try:
                return int(value)
            except ValueError:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from None
    return None


def _first(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set (for messages); the last if none is."""
    return next((n for n in names if _given(env, n)), names[-1])


def _identity(
    env: Mapping[str, str],
    rank_names: tuple[str, ...],
    size_names: tuple[str, ...],
    local_names: tuple[str, ...],
    local_size_names: tuple[str, ...] = (),
) -> tuple[int, int, int | None, int | None]:
    """(rank, size, local rank, local size), checked: a bad value names its variable."""
    rank = _env_int(env, *rank_names)
    size = _env_int(env, *size_names)
    rank_name, size_name = _first(env, *rank_names), _first(env, *size_names)
    if rank is None or size is None:
        missing = rank_name if rank is None else size_name
        raise ValueError(
            f"environment variable {missing} is not set, but "
            f"{size_name if rank is None else rank_name} is: cannot tell this rank's place"
        )
    if size < 1:
        raise ValueError(f"environment variable {size_name}={size}: the size must be at least 1")
    if not 0 <= rank < size:
        raise ValueError(
            f"environment variable {rank_name}={rank} is out of range for "
            f"{size_name}={size} (expected 0 <= rank < size)"
        )
    local = _env_int(env, *local_names)
    local_size = _env_int(env, *local_size_names) if local_size_names else None
    if local_size is not None and not 1 <= local_size <= size:
        raise ValueError(
            f"environment variable {_first(env, *local_size_names)}={local_size} is out of "
            f"range for {size_name}={size} (expected 1 <= local size <= size)"
        )
    if local is not None and not 0 <= local < (local_size or size):
        bound = local_size_names[0] if local_size is not None else size_name
        raise ValueError(
            f"environment variable {_first(env, *local_names)}={local} is out of range for "
            f"{bound}={local_size or size} (expected 0 <= local rank < that)"
        )
    return rank, size, local, local_size


def _master_store(env: Mapping[str, str]) -> str | None:
    """URL of the store rank 0 serves at MASTER_ADDR:MASTER_PORT+1, if MASTER_ADDR is set."""
    if not _given(env, "MASTER_ADDR"):
        return None
    port = _env_int(env, "MASTER_PORT")
    if port is None:
        port = DEFAULT_MASTER_PORT
    if not 1 <= port <= 65534:
        raise ValueError(
            f"environment variable MASTER_PORT={port} is out of range: plait's store takes "
            "MASTER_PORT + 1, so expected 1 <= MASTER_PORT <= 65534"
        )
    return f"tcp://{_bracket(env['MASTER_ADDR'].strip())}:{port + 1}"


def first_slurm_host(nodelist: str) -> str | None:
    """The first host of a Slurm node list such as ``node[07-09,12],gpu1``.

    Slurm places task 0 of a step on the first node of the step's list (with
    block and cyclic distributions alike), so that host serves the store.
    """
    host = []
    i = 0
    text = nodelist.strip()
    while i < len(text) and text[i] != ",":
        if text[i] == "[":
            end = text.find("]", i)
            if end < 0:
                return None
            host.append(text[i + 1 : end].split(",")[0].split("-")[0])
            i = end + 1
        else:
            host.append(text[i])
            i += 1
    return "".join(host) or None


def _slurm_store(env: Mapping[str, str], job: str) -> str | None:
    """Under a multi-node srun without MASTER_ADDR: rank 0 serves the store on its node.

    The host is the first of the step's node list; the port MASTER_PORT + 1
    when MASTER_PORT is set, else one derived from the job and step ids in
    20000..29999, so that two jobs sharing a node do not collide.
    """
    nodelist = next(
        (
            env[n]
            for n in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if _given(env, n)
        ),
        None,
    )
    host = None if nodelist is None else first_slurm_host(nodelist)
    if host is None:
        return None
    port = _env_int(env, "MASTER_PORT")
    port = port + 1 if port is not None else 20000 + zlib.crc32(job.encode()) % 10000
    return f"tcp://{_bracket(host)}:{port}"


def _temp_store_url(job: str, unique: str) -> str:
    """``file://`` URL of this user's directory for ``job`` in the temp dir."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job)[:80]
    if unique or safe != job:
        safe += "-" + hashlib.sha256(f"{job}\0{unique}".encode()).hexdigest()[:10]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    path = os.path.join(os.path.abspath(tempfile.gettempdir()), f"plait-{uid}-{safe}")
    return "file://" + urllib.parse.quote(path)


def _outer_launcher(
    env: Mapping[str, str],
) -> tuple[str, tuple[int, int, int | None, int | None], str | None, bool | None, str] | None:
    """mpirun's or srun's (name, identity, job id, single host?, uniqueness salt), if any."""
    if _given(env, "OMPI_COMM_WORLD_RANK"):
        ident = _identity(
            env,
            ("OMPI_COMM_WORLD_RANK",),
            ("OMPI_COMM_WORLD_SIZE",),
            ("OMPI_COMM_WORLD_LOCAL_RANK",),
            ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        )
        job = next(
            (
                env[n].strip()
                for n in ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")
                if _given(env, n)
            ),
            None,
        )
        single = None if ident[3] is None else ident[3] == ident[1]
        # Open MPI 4's job ids hash (host, mpirun pid) into 16 bits; the URI of
        # mpirun (its random port) tells apart two jobs that collide.
        return "mpirun", ident, job, single, env.get("OMPI_MCA_orte_hnp_uri", "")
    if _given(env, "SLURM_PROCID") and (
        _given(env, "SLURM_STEP_ID") or _given(env, "SLURM_STEPID")
    ):
        ident = _identity(
            env,
            ("SLURM_PROCID",),
            ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
            ("SLURM_LOCALID",),
        )
        step = env.get("SLURM_STEP_ID", "").strip() or env["SLURM_STEPID"].strip()
        job_id = env.get("SLURM_JOB_ID", "").strip() or env.get("SLURM_JOBID", "").strip()
        job = f"{job_id or '0'}.{step}"
        restarts = _env_int(env, "SLURM_RESTART_COUNT")
        if restarts:
            job += f".r{restarts}"
        nodes = _env_int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        return "srun", ident, job, None if nodes is None else nodes == 1, ""
    return None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read rank, size and rendezvous from the environment of a known launcher.

    See Note [how ranks find each other] for the variables read and which
    launcher wins when several have left theirs.

    Raises:
        ValueError: a variable that should hold a number does not, or the
            numbers are inconsistent (rank not below size, ...); the message
            names the variable.
    """
    env = dict(os.environ if env is None else env)
    url = env.get("PLAIT_STORE", "").strip() or None
    own = env.get("PLAIT_JOB_ID", "").strip() or None  # names the job under every launcher
    if _given(env, "PLAIT_RANK"):
        rank, size, local, local_size = _identity(
            env, ("PLAIT_RANK",), ("PLAIT_SIZE",), ("PLAIT_LOCAL_RANK",), ("PLAIT_LOCAL_SIZE",)
        )
        by_rank0 = False
        if url is None:  # ranks started by hand next to torch's variables: as torchrun's
            url = _master_store(env)
            by_rank0 = url is not None
        return LaunchInfo(
            "plait",
            rank,
            size,
            local,
            url,
            by_rank0 and rank == 0,
            own,
            local_size,
            store_by_rank0=by_rank0,
        )

    torch_ident = None
    if _given(env, "RANK") and _given(env, "WORLD_SIZE"):  # one alone is someone's setting
        torch_ident = _identity(
            env, ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)
        )
    under_torchrun = torch_ident is not None and _given(env, "TORCHELASTIC_RUN_ID")
    outer = None if under_torchrun else _outer_launcher(env)
    if outer is not None:
        name, ident, job, single, unique = outer
        if torch_ident is None or torch_ident[:2] == ident[:2]:
            rank, size, local, local_size = ident
            by_rank0 = temp = False
            if url is None:
                url = _master_store(env)
                by_rank0 = url is not None
            if url is None and job and single is not False:
                url, temp = _temp_store_url(job, unique), True
            if url is None and name == "srun":
                url = _slurm_store(env, job or "")
                by_rank0 = url is not None
            return LaunchInfo(
                name,
                rank,
                size,
                local,
                url,
                by_rank0 and rank == 0,
                own or job,
                local_size=local_size,
                store_is_temp=temp,
                store_by_rank0=by_rank0,
            )
    if torch_ident is not None:
        rank, size, local, local_size = torch_ident
        by_rank0 = False
        if url is None:
            url = _master_store(env)
            by_rank0 = url is not None
        return LaunchInfo(
            "torchrun",
            rank,
            size,
            local,
            url,
            by_rank0 and rank == 0,
            own or env.get("TORCHELASTIC_RUN_ID", "").strip() or None,
            local_size=local_size,
            store_by_rank0=by_rank0,
        )
    several = env.get("PLAIT_SIZE", "").strip()
    if several not in ("", "1"):  # a job of several without this rank's number: not one alone
        raise ValueError(
            f"PLAIT_SIZE is {several!r} but PLAIT_RANK is not set: each process of a job of "
            "several needs its rank in PLAIT_RANK (0 to PLAIT_SIZE - 1); unset PLAIT_SIZE to "
            "run alone"
        )
    return LaunchInfo("none", 0, 1, None, url, False, None)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or accept it if it is already this user's private directory."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if (
        not stat.S_ISDIR(st.st_mode)
        or (hasattr(os, "getuid") and st.st_uid != os.getuid())
        or st.st_mode & 0o077
    ):
        raise RendezvousError(
            f"{path} exists but is not a private directory of this user: plait will not "
            "rendezvous through it (delete it, or set PLAIT_STORE)"
        )


def _open_store(info: LaunchInfo, rank: int, generation: int, timeout: float | None) -> Store:
    """Connect to the store the environment names (rank 0 may serve it)."""
    from plait.rendezvous.store import DEFAULT_STORE_TIMEOUT
    from plait.rendezvous.tcp_store import TCPStore, TCPStoreServer
    from plait.rendezvous.url import store_from_url

    assert info.store_url is not None
    seconds = DEFAULT_STORE_TIMEOUT if timeout is None else timeout
    if info.store_is_temp:
        from plait.rendezvous.file_store import FileStore

        path = f"{urllib.parse.unquote(urllib.parse.urlsplit(info.store_url).path)}-{generation}"
        _private_dir(path)
        return FileStore(path, timeout=seconds)
    if not info.store_is_server:
        return store_from_url(info.store_url, rank=rank, timeout=timeout)
    parts = urllib.parse.urlsplit(info.store_url)
    host, port = parts.hostname or "", parts.port or 0
    with _servers_lock:
        server = _servers.get((host, port))
        if server is None:
            try:
                server = TCPStoreServer(host, port)
            except RendezvousError as exc:
                raise RendezvousError(
                    f"rank {rank}: {exc}. plait's rank 0 serves its store on MASTER_PORT + 1, "
                    "next to torch's on MASTER_PORT: that port must be free on MASTER_ADDR "
                    "(pick another MASTER_PORT, or set PLAIT_STORE)"
                ) from exc
            _servers[(host, port)] = server  # kept for the process: Note [store lifetime]
    return TCPStore(host, port, timeout=seconds)


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
            (``tcp://host:port``, ``file:///path``, ``redis://host:port``);
            default from the environment. A URL is connected to and closed
            again before ``init`` returns; a Store object is left open.
        timeout: default seconds per call (PLAIT_TIMEOUT, else 300), also the
            rendezvous deadline.
        transport: ``"auto"`` (default: per peer pair, shared memory within a
            host and TCP across hosts), ``"shm"``, ``"tcp"``, ``"hybrid"``, or
            an already connected transport object (rank and size then come
            from it).

    With no arguments and no launcher environment, returns a single-rank
    communicator, as an MPI program started without mpirun does.

    Raises:
        RendezvousError: the other ranks could not be reached in time, or the
            environment does not say where they meet.
        ValueError: a bad argument, or a launcher variable that is not a
            valid number (the message names it).
    """
    # Flight-recorder dumps on SIGUSR1 and on a stall (docs/debugging.md): once per
    # process; the handler only from the main thread, where Python runs handlers.
    from plait.diagnostics.triggers import install_signal_handler, start_watchdog

    install_signal_handler()
    start_watchdog()
    die_with_launcher(os.environ.get("PLAIT_LAUNCHER_PID"))
    check_arguments(rank, size, store, transport)
    if transport is not None and not isinstance(transport, str):
        if rank is not None and rank != transport.rank:
            raise ValueError(f"rank={rank} disagrees with the transport's rank {transport.rank}")
        if size is not None and size != transport.size:
            raise ValueError(f"size={size} disagrees with the transport's size {transport.size}")
        return Communicator(transport, timeout=timeout)
    setting = os.environ.get("PLAIT_TRANSPORT", "").strip()
    kind = (transport or setting or "auto").strip().lower()
    if kind not in TRANSPORTS:
        said = f"transport={transport!r}" if transport else f"PLAIT_TRANSPORT={setting!r}"
        raise ValueError(f"{said} is not a transport; expected one of {', '.join(TRANSPORTS)}")
    # On/off settings read here, so that a bad one fails before anything moves.
    recovery = env_switch(os.environ, "PLAIT_RECOVERY", True)
    env_switch(os.environ, "PLAIT_BIND", True)
    info = detect_launch()
    rank = info.rank if rank is None else int(rank)
    size = info.size if size is None else int(size)
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid rank {rank} for size {size}; expected 0 <= rank < size")
    if timeout is None and os.environ.get("PLAIT_TIMEOUT", "").strip():
        timeout = default_timeout()
    elif timeout is not None:  # one check for every phase (inf is the longest timeout)
        timeout = check_timeout(timeout, "init")
    if size == 1:
        return Communicator(MemoryFabric(1).endpoints[0], timeout=timeout, hosts=(host_name(),))
    config = settings()  # a bad rules file or PLAIT_ALGO fails before anything moves

    global _generation
    with _generation_lock:
        _generation += 1
        generation = _generation
    seconds = timeout if timeout is not None else 300.0
    deadline = time.monotonic() + seconds  # one deadline for every phase of init

    def left() -> float:
        return max(deadline - time.monotonic(), 0.001)

    owned = from_env = False  # init opened the store (and must close it); from the environment
    if store is None:
        if info.store_url is None:
            why = {
                "mpirun": "mpirun placed the ranks on several hosts, where a file store in the "
                "temp dir cannot reach them all; ",
                "srun": "srun placed the ranks on several hosts and no SLURM_STEP_NODELIST "
                "names them; ",
                "torchrun": "RANK and WORLD_SIZE are set but MASTER_ADDR is not; ",
            }.get(info.launcher, "")
            raise RendezvousError(
                f"rank {rank} of {size}: cannot find the other ranks: {why}set MASTER_ADDR "
                "(rank 0's host) and MASTER_PORT: rank 0 serves a store on MASTER_PORT + 1; or "
                "set PLAIT_STORE=tcp://host:port, or pass store=, or start the job with "
                "`plait run`"
            )
        store = _open_store(info, rank, generation, None if timeout is None else left())
        owned = from_env = True
    elif isinstance(store, str):
        from plait.rendezvous.url import store_from_url

        store = store_from_url(store, rank=rank, timeout=timeout)
        owned = True
    # Under plait run, rank r is job rank r: a rank the launcher saw die is filed where
    # the start-up waits look (Note [lost ranks] in plait.rendezvous.lost).
    job_ranks = from_env and info.launcher == "plait" and (rank, size) == (info.rank, info.size)
    job_id = job_space(info, url=not from_env) if owned else None  # Note [jobs that share a store]
    group = (JobRanks if job_ranks else PrefixStore)(init_space(generation, job_id), store)
    t: Any = None
    temp = info.store_is_temp and from_env
    kept = False  # the communicator keeps the store (Note [store lifetime])
    try:
        host = host_name()
        claim_rank(group, rank, size, job_id, info.launcher)
        if rank == 0:  # before its host: a rank that has met every host reads it
            group.set("run", f"{secrets.token_hex(6)} {size}".encode())
        mine = (host, kind, fingerprint(config))  # Note [one configuration] in plait._meeting
        wait = None if timeout is None else left()
        world = (rank, size) == (info.rank, info.size)  # the job's own (not a torch group's)
        hosts, again = meet(group, rank, size, mine, seconds, wait, info, temp=temp, world=world)
        run, _, sized = group.get("run").decode().partition(" ")
        if sized != str(size):  # launchers of one job told its ranks different sizes
            raise RendezvousError(
                f"rank {rank} of {size}: rank 0 is in a job of {sized} ranks, this rank in one "
                f"of {size}: the ranks' launchers disagree on the job's size (plait run: the "
                "same -n and --nnodes on every host)"
            )
        # One place chooses the link per peer pair (plait.transport.route); "hybrid" and
        # "auto" allow both kinds, shared memory first.
        from plait.transport.route import LINKS, connect

        links = {"shm": ("shm",), "tcp": ("tcp",)}.get(kind, LINKS)
        # Only plait run cleans /dev/shm by job id; elsewhere rank 0 draws a
        # fresh token, so that jobs with equal ids (torchrun's default run id
        # is "none") never share segment names.
        job = info.job_id if info.launcher == "plait" else None
        try:
            t = connect(rank, size, hosts, group, links=links, timeout=left(), job=job)
        except CommError as exc:  # the others' waits for this rank end now
            report_gave_up(group, rank, str(exc))  # Note [ranks that gave up]
            raise
        comm = Communicator(
            t,
            timeout=timeout,
            hosts=hosts,
            _settings=config,
            _run=run,
            _members=range(size) if world else None,
            # its dumps are not the world's (Note [two worlds in one process])
            _comm_id=0 if world and not again else own_comm_id(run),
        )
        if world:
            world_made(comm)
        if "shm" in links:  # ranks that share a host's memory wait by yielding to each other
            bind_crowded(rank, hosts)
        # A store passed as an object is the caller's (torch's, in the torch backend), and the
        # temp-dir file store must be let go at once: no watcher thread on either, and no agree
        # or shrink (Note [store lifetime]).
        if owned and not temp and recovery:
            kept = _keep_store(comm, store, group, size, owned=owned, temp=temp, links=links)
        elif not owned:
            comm._no_recovery = (
                "made with a store object (store=; the torch backend lends torch's), on which "
                "init starts no thread"
            )
        elif temp:
            comm._no_recovery = (
                "met through a file store in the temp dir (mpirun or srun on one host), which "
                "init lets go; set PLAIT_STORE or MASTER_ADDR for agree and shrink"
            )
        else:
            comm._no_recovery = "made with PLAIT_RECOVERY=0"
    finally:
        if owned and not kept:
            leave(store, group, size, temp=temp)
    return comm


def _keep_store(
    comm: Communicator,
    store: Store,
    group: PrefixStore,
    size: int,
    *,
    owned: bool,
    temp: bool,
    links: tuple[str, ...],
) -> bool:
    """Give ``comm`` its recovery over ``store`` (Note [store lifetime]); closes ``comm`` if
    that fails. True: the store is the communicator's to let go of now."""
    from plait._recovery import enable
    from plait.rendezvous.store import StoreOwner

    def release() -> None:
        if owned:
            leave(store, group, size, temp=temp)

    def count_out(n: int) -> None:
        if temp and n:
            group.add("left", n)

    try:
        enable(comm, StoreOwner(store, release, count_out), f"{group.prefix}ft", links)
    except BaseException:
        comm.close()
        raise
    return True
