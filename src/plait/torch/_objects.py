"""torch.distributed's ``*_object`` functions on plait's object collectives, for plait groups.

torch 2.13 gives a backend no hook for ``all_gather_object``,
``gather_object``, ``broadcast_object_list``, ``scatter_object_list``,
``send_object_list`` and ``recv_object_list``: they are functions of
``torch.distributed.distributed_c10d`` that pickle each object into a byte
tensor in Python and then call the group's tensor collectives (padding every
pickle to the largest in the gathers and the scatter). So :func:`install`
replaces those six functions, once, in ``torch.distributed`` and in
``torch.distributed.distributed_c10d`` (where torch's own modules and the
``from torch.distributed import *`` of user code find them), with wrappers that
serve a "plait" group with the communicator's ``allgather_object``,
``gather_object``, ``bcast_object``, ``scatter_object``, ``send_object`` and
``recv_object`` (pickle protocol 5, arrays and tensors out of band, each object
at its own size, 64-bit lengths) and call torch's own function for every other
group (gloo, nccl, a rank outside the group) and before any group exists.

Note [the same call as torch's]
    A wrapper binds its arguments with the signature of torch's function, so
    names, defaults and positional use are torch's, and it refers the call
    to torch's function when an argument it does not know is set. Ranks go
    through torch's own helpers (``_canonicalize_group_rank``:
    ``dst``/``src`` are global ranks, ``group_dst``/``group_src`` the
    group's, giving both is a ValueError, and the collectives default to
    global rank 0 as torch's do), and so do the argument checks torch makes
    before anything moves (``_validate_output_list_for_rank``,
    ``_check_not_self_rank``, the scatter's list checks), with torch's
    wording. Results land in the caller's list in place as torch puts them
    (``object_list[i] = ...``; a source keeps its own objects) and
    ``recv_object_list`` returns the sender's global rank. ``device`` and
    ``use_batch`` only say where and how torch would move its byte tensors:
    plait moves no byte tensors, so they change nothing. Two differences,
    both where torch's fail: an empty ``object_list`` (``broadcast_object_list``,
    ``send_object_list``) is sent as an empty list, where torch's fails on
    the source and leaves the other ranks waiting; and a receiver whose
    list is not as long as the source's raises ValueError, where torch's
    fails on the sizes' mismatch.

Note [order with the group's other calls]
    The object collectives are blocking calls of the group's communicator on
    the caller's thread, like the group's blocking collectives, so they keep
    their place among its calls on every rank. ``send_object_list`` runs on
    the group's send lane for (peer, tag 0), the one ``dist.send`` and
    ``dist.isend`` with tag 0 use, so it never overtakes an earlier
    ``isend`` to that peer; ``recv_object_list`` posts its receives on the
    caller's thread after every receive called before it (Note [point to
    point on lanes] in ``plait.torch._p2p``).

Set PLAIT_TORCH_OBJECTS=0 (or false/no/off) before ``import plait.torch`` to
leave torch's functions alone; the setting must be the same on every rank,
since the two ways move different messages. Any other value but 1 (true/yes/on)
makes ``import plait.torch`` raise ValueError.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from plait._checks import env_switch
from plait.errors import CommError
from plait.torch._backend import ProcessGroupPlait

__all__ = ["ENV", "NAMES", "enabled", "install", "installed", "original", "uninstall"]

#: The environment variable that turns the wrappers off ("0", "false", "no", "off"; any
#: other value but "1", "true", "yes", "on" is refused).
ENV = "PLAIT_TORCH_OBJECTS"
#: torch's functions that the wrappers replace.
NAMES = (
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
#: torch's private helpers the wrappers check arguments with; without them, no wrappers.
_HELPERS = (
    "_canonicalize_group_rank",
    "_check_not_self_rank",
    "_validate_output_list_for_rank",
    "_get_default_group",
)
#: Marks a wrapper (its value: torch's function it wraps).
_MARK = "__plait_torch_original__"

#: What serves a plait group: (the group, the bound arguments) -> the call's result.
_Serve = Callable[[ProcessGroupPlait, dict[str, Any]], Any]


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether PLAIT_TORCH_OBJECTS asks for the wrappers (unset or empty: yes).

    Raises:
        ValueError: a value other than ``1``, ``true``, ``yes``, ``on``, ``0``, ``false``,
            ``no``, ``off`` (any case), as for PLAIT_BIND; any such value used to mean on.
    """
    env = os.environ if environ is None else environ
    return env_switch(env, ENV, True)


def original(name: str) -> Callable[..., Any]:
    """torch's own function ``name`` (one of :data:`NAMES`), wrapped or not."""
    fn: Callable[..., Any] = getattr(c10d, name)
    torch_fn: Callable[..., Any] = getattr(fn, _MARK, fn)
    return torch_fn


def installed() -> bool:
    """Whether ``torch.distributed``'s six functions are the wrappers now."""
    return all(hasattr(getattr(m, n), _MARK) for m in (dist, c10d) for n in NAMES)


def install() -> bool:
    """Replace the six functions with the wrappers (idempotent); whether they are in place.

    A function already replaced by someone else in either module is left as
    it is there; nothing is installed if torch lacks a helper the wrappers need.
    """
    if not all(hasattr(c10d, h) for h in _HELPERS):
        return False
    for name in NAMES:
        torch_fn = original(name)
        serve, known = _SERVE[name]
        if not known <= set(inspect.signature(torch_fn).parameters):
            continue  # another torch's function: its arguments are not the ones served here
        wrapper = _wrap(torch_fn, serve, known)
        for module in (c10d, dist):
            current = getattr(module, name, None)
            if current is torch_fn:
                setattr(module, name, wrapper)
    return installed()


def uninstall() -> None:
    """Put torch's own six functions back where the wrappers are."""
    for name in NAMES:
        for module in (c10d, dist):
            current = getattr(module, name, None)
            if hasattr(current, _MARK):
                setattr(module, name, getattr(current, _MARK))


def _wrap(torch_fn: Callable[..., Any], serve: _Serve, known: frozenset[str]) -> Callable[..., Any]:
    """torch's ``torch_fn`` for other groups, ``serve`` for plait groups (Note above).

    ``known``: the arguments ``serve`` reads or may ignore; any other one set
    to a value other than its default sends the call to torch's function.
    """
    signature = inspect.signature(torch_fn)

    @functools.wraps(torch_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return torch_fn(*args, **kwargs)  # torch's own TypeError
        bound.apply_defaults()
        a = bound.arguments
        pg = _plait_group(a.get("group"))
        unknown = any(
            a[p.name] is not p.default for p in signature.parameters.values() if p.name not in known
        )
        if pg is None or unknown or not _torch_pickle():
            return torch_fn(*args, **kwargs)
        try:
            return serve(pg, a)
        except CommError as exc:  # a sub-group's ranks named by their global ranks too
            raise pg._named(exc)  # noqa: B904 - chained by globally_named()

    setattr(wrapper, _MARK, torch_fn)
    return wrapper


def _plait_group(group: Any) -> ProcessGroupPlait | None:
    """The plait group a call runs on (None: the default group), or None for any other."""
    if group is None:
        if not dist.is_initialized():
            return None
        group = c10d._get_default_group()
    return group if isinstance(group, ProcessGroupPlait) else None


def _torch_pickle() -> bool:
    """Whether torch pickles with pickle's own classes (a replaced pickler keeps torch's path)."""
    return c10d._pickler is pickle.Pickler and c10d._unpickler is pickle.Unpickler


def _rank(pg: ProcessGroupPlait, rank: int | None, group_rank: int | None, default: bool) -> int:
    """The group rank from torch's (global ``rank``, ``group_rank``) pair, as torch reads it."""
    if default and rank is None and group_rank is None:
        rank = 0
    return c10d._canonicalize_group_rank(pg, rank, group_rank, return_global=False)


def _fill(out: Any, got: list[Any], what: str, c: str) -> None:
    """``out[i] = got[i]`` for the receiver's list ``out``, which must be as long."""
    if len(out) != len(got):
        raise ValueError(
            f"{c}: {what} has {len(out)} entries but {len(got)} objects were sent; "
            "every rank must pass a list of the same length"
        )
    for i, obj in enumerate(got):
        out[i] = obj


# -- what serves a plait group: torch's arguments, plait's calls ------------------------------
def all_gather_object(pg: ProcessGroupPlait, a: dict[str, Any]) -> None:
    """``dist.all_gather_object``: ``allgather_object``, into ``object_list``."""
    out = a["object_list"]
    for i, obj in enumerate(pg.communicator.allgather_object(a["obj"])):
        out[i] = obj


def gather_object(pg: ProcessGroupPlait, a: dict[str, Any]) -> None:
    """``dist.gather_object``: ``gather_object``, into ``object_gather_list`` on the root."""
    root = _rank(pg, a["dst"], a["group_dst"], default=True)
    out = a["object_gather_list"]
    c10d._validate_output_list_for_rank(pg.rank(), root, out)
    got = pg.communicator.gather_object(a["obj"], root)
    if got is not None:
        for i, obj in enumerate(got):
            out[i] = obj


def broadcast_object_list(pg: ProcessGroupPlait, a: dict[str, Any]) -> None:
    """``dist.broadcast_object_list``: one ``bcast_object`` of the source's whole list."""
    root = _rank(pg, a["src"], a["group_src"], default=True)
    objs = a["object_list"]
    if pg.rank() == root:
        pg.communicator.bcast_object(list(objs), root)
        return
    got = pg.communicator.bcast_object(None, root)
    _fill(objs, got, "object_list", f"rank {pg.rank()}: broadcast_object_list")


def scatter_object_list(pg: ProcessGroupPlait, a: dict[str, Any]) -> None:
    """``dist.scatter_object_list``: ``scatter_object``, into the output list's first entry."""
    root = _rank(pg, a["src"], a["group_src"], default=True)
    out, objs = a["scatter_object_output_list"], a["scatter_object_input_list"]
    if not isinstance(out, list) or len(out) < 1:  # torch's checks and words
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    mine = pg.rank() == root
    if mine and objs is None:
        raise ValueError("source rank must provide non-None scatter_object_input_list")
    out[0] = pg.communicator.scatter_object(list(objs) if mine else None, root)


def send_object_list(pg: ProcessGroupPlait, a: dict[str, Any]) -> None:
    """``dist.send_object_list``: ``send_object`` of the whole list, on the send lane."""
    peer = _rank(pg, a["dst"], a["group_dst"], default=False)
    c10d._check_not_self_rank(pg, peer, "destination")
    pg.send_object(list(a["object_list"]), peer)


def recv_object_list(pg: ProcessGroupPlait, a: dict[str, Any]) -> int:
    """``dist.recv_object_list``: ``recv_object`` into ``object_list``; the sender's global rank."""
    peer = _rank(pg, a["src"], a["group_src"], default=False)
    c10d._check_not_self_rank(pg, peer, "source")
    got = pg.communicator.recv_object(peer)
    _fill(a["object_list"], got, "object_list", f"rank {pg.rank()}: recv_object_list")
    return dist.get_global_rank(pg, peer)


#: Arguments that change only how torch moves its byte tensors (Note [the same call as torch's]).
_IGNORED = frozenset({"device", "use_batch"})
#: Each function's server and the arguments of torch's function it takes care of.
_SERVE: dict[str, tuple[_Serve, frozenset[str]]] = {
    "all_gather_object": (all_gather_object, frozenset({"object_list", "obj", "group"})),
    "gather_object": (
        gather_object,
        frozenset({"obj", "object_gather_list", "dst", "group", "group_dst"}),
    ),
    "broadcast_object_list": (
        broadcast_object_list,
        frozenset({"object_list", "src", "group", "device", "group_src"}),
    ),
    "scatter_object_list": (
        scatter_object_list,
        frozenset(
            {"scatter_object_output_list", "scatter_object_input_list", "src", "group", "group_src"}
        ),
    ),
    "send_object_list": (
        send_object_list,
        frozenset({"object_list", "dst", "group", "group_dst"}) | _IGNORED,
    ),
    "recv_object_list": (
        recv_object_list,
        frozenset({"object_list", "src", "group", "group_src"}) | _IGNORED,
    ),
}
