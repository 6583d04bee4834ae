"""Making and finding "plait" process groups.

:func:`create_process_group` is the creator torch calls for
``init_process_group("plait")`` and ``new_group(backend="plait")``;
:func:`communicator` finds the :class:`plait.Communicator` behind a group, for
plait's own calls (the object collectives above all) on a torch group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import plait
from plait.communicator import default_timeout
from plait.errors import CommError
from plait.torch._backend import ProcessGroupPlait
from plait.torch._convert import seconds
from plait.torch._store import TorchStore
from plait.torch._work import globally_named

__all__ = ["communicator", "create_process_group", "monitored_barrier", "plait_group"]


def create_process_group(backend_opts: Any, pg_options: Any) -> ProcessGroupPlait:
    """Make this rank's plait process group; torch calls it (``extended_api=True``).

    The ranks meet through the store torch passes (see Note [which store the
    plait backend uses] in ``plait.torch._store``). ``init_process_group``'s
    ``timeout`` becomes plait's per-call timeout, except torch's default of 30
    minutes, which is replaced by plait's own default (PLAIT_TIMEOUT, else 300 s).

    Raises:
        TypeError: ``pg_options`` were given (the plait backend takes none).
        plait.RendezvousError: the ranks could not meet in time.
    """
    if pg_options is not None:
        raise TypeError(
            "the plait backend takes no pg_options; set PLAIT_TRANSPORT or PLAIT_TIMEOUT "
            f"in the environment instead (got {type(pg_options).__name__})"
        )
    timeout = backend_opts.timeout
    explicit = timeout is not None and timeout != default_pg_timeout
    call_timeout = seconds(timeout) if explicit else None
    store = TorchStore(
        backend_opts.store, call_timeout or default_timeout(), backend_opts.group_size
    )
    ranks = list(backend_opts.global_ranks_in_group)
    try:
        comm = plait.init(
            rank=backend_opts.group_rank,
            size=backend_opts.group_size,
            store=store,
            timeout=call_timeout,
        )
    except CommError as exc:  # a sub-group's ranks by their global ranks too, as its calls'
        named = globally_named(exc, None if ranks == list(range(len(ranks))) else ranks)
        named.add_note(
            "plait.init is how the plait backend makes this process group "
            "(dist.init_process_group, dist.new_group): every rank of the group must call it"
        )
        raise named  # noqa: B904 - chained by globally_named()
    return ProcessGroupPlait(comm, global_ranks=ranks, store=store)


def communicator(group: dist.ProcessGroup | None = None) -> plait.Communicator:
    """The :class:`plait.Communicator` that runs a "plait" process group's calls.

    For plait's own calls on a torch group: the object collectives torch has
    no function for (``alltoall_object``, ``allreduce_object``), tags of
    one's choice, and anything else of :class:`plait.Communicator`.
    ``dist.all_gather_object`` and torch's other ``*_object`` functions
    already run the communicator's object collectives on a plait group
    (``plait.torch._objects``; docs/torch.md, "Object collectives"). Its
    ranks are the group's (``dist.get_rank(group)``).

    Args:
        group: a process group of the "plait" backend; None: the default group.

    Raises:
        TypeError: the group is not one of the plait backend.
    """
    return plait_group(group, "plait.torch.communicator").communicator


def monitored_barrier(
    group: dist.ProcessGroup | None = None, timeout: Any = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for the plait backend: names the ranks that did not arrive.

    torch implements ``dist.monitored_barrier`` for gloo only; this is its
    equivalent for a "plait" group, with the same arguments. It returns once
    every rank of the group has called it; otherwise every rank raises
    :class:`plait.CommTimeout` within ``timeout``, rank 0 naming every rank
    that did not arrive and the others repeating rank 0's list. It meets
    through the store the group was made with, not through the connections,
    so the group stays usable after a failure (Note [monitored barrier] in
    ``plait.torch._monitored``).

    Args:
        group: a process group of the "plait" backend; None: the default group.
        timeout: a timedelta or seconds; None: the group's timeout.
        wait_all_ranks: accepted for torch's signature; every missing rank is
            named either way.

    Raises:
        plait.CommTimeout: some rank did not arrive in time (named).
        plait.RendezvousError: the store failed (its server gone with the rank
            that served it); the message says at which step.
        TypeError: the group is not one of the plait backend.
    """
    if group is not None and dist.distributed_c10d._rank_not_in_group(group):
        # torch's rule for a group's call on a rank outside it (dist.monitored_barrier too)
        dist.distributed_c10d._warn_not_in_group("monitored_barrier")
        return
    pg = plait_group(group, "plait.torch.monitored_barrier")
    pg.monitored_barrier(timeout, wait_all_ranks)


def plait_group(group: Any, who: str, hint: str = "") -> ProcessGroupPlait:
    """``group`` (None: the default group) as a "plait" process group, or TypeError from ``who``."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if dist.distributed_c10d._rank_not_in_group(pg):  # what new_group gave a non-member
        raise ValueError(
            f"{who}: this rank is not in the group (dist.new_group gave it "
            "GroupMember.NON_GROUP_MEMBER): only the group's ranks have its communicator"
        )
    if not isinstance(pg, ProcessGroupPlait):
        raise TypeError(
            f"{who} needs a process group of the 'plait' backend; got {pg!r} "
            f'(initialise with dist.init_process_group("plait"){hint})'
        )
    return pg
