"""The Ray collective group whose calls plait runs (``backend="plait"``).

Note [how Ray calls a collective group]
    ``ray.util.collective`` keeps one group object per (process, group name)
    and calls its methods with each tensor wrapped in a list (``[tensor]``;
    the ``*_multigpu`` calls pass several, one per GPU) and an options object
    (sometimes the options class itself, with class attributes set): the
    reduce op, the root, and a ``timeout_ms`` that is a negative timedelta
    when unset. ``barrier`` alone is called with no options; the group then
    reads Ray's ``BarrierOptions`` class, as Ray's own groups do (their
    default is ``BarrierOptions()``, whose ``timeout_ms`` is the class's).
    Ray creates the group either when an actor calls
    ``init_collective_group`` or, after the driver's
    ``create_collective_group``, lazily on the actor's first collective
    call; either way it constructs ``PlaitGroup(world_size, rank,
    group_name)``, which is the collective rendezvous. ``destroy_group`` is
    local and may run after a peer died.

The group serves numpy arrays and CPU torch tensors, bfloat16 ones too
(plait reads and writes them in place, as the communicator reads them);
reduce-scatter is plait's own, not n all-reduces.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
from ray.util.collective import types
from ray.util.collective.collective_group.base_collective_group import BaseGroup

import plait
from plait import _tensor
from plait.communicator import DEFAULT_TIMEOUT, default_timeout
from plait.errors import UnsupportedError
from plait.ray._rendezvous import Meeting, adopt_secret, create, group_namespace, job_namespace
from plait.ray._store import RayKeyValue
from plait.runtime.work import check_timeout

__all__ = ["BACKEND_NAME", "DEFAULT_TIMEOUT", "PlaitGroup"]

#: The name Ray knows the backend by (Ray upper-cases backend names).
BACKEND_NAME = "PLAIT"
#: Ray's reduce ops (by name) as plait's.
_OPS = {"SUM": plait.SUM, "PRODUCT": plait.PROD, "MIN": plait.MIN, "MAX": plait.MAX}


def _seconds(options: Any) -> float | None:
    """The call's timeout from Ray's options (None: the communicator's default)."""
    value = getattr(options, "timeout_ms", None)
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float):
        seconds = float(value) / 1000.0
    else:
        return None
    return seconds if seconds > 0 else None


def _op(options: Any) -> plait.Op:
    """Ray's reduce op as plait's (a plait Op passes through: AVG, BAND, …)."""
    op = getattr(options, "reduceOp", None)
    if op is None:
        return plait.SUM
    if isinstance(op, plait.Op):
        return op
    name = getattr(op, "name", str(op))
    if name not in _OPS:
        raise UnsupportedError(f"plait's Ray backend: unknown reduce op {op!r}")
    return _OPS[name]


def _one(tensors: Any, what: str) -> Any:
    """The single tensor of Ray's ``[tensor]`` (a bare tensor is accepted too)."""
    if isinstance(tensors, list | tuple):
        if len(tensors) != 1:
            raise UnsupportedError(
                f"plait's Ray backend: {what} takes one tensor per process, got {len(tensors)} "
                "(the *_multigpu calls are NCCL's)"
            )
        return tensors[0]
    return tensors


def _view(t: Any, what: str) -> np.ndarray[Any, Any]:
    """A numpy view of ``t`` sharing its memory (numpy arrays and CPU torch tensors).

    A tensor is read as the communicator reads it (:func:`plait._tensor.as_array`),
    so bfloat16 tensors are ml_dtypes' bfloat16 here as in ``allreduce``.
    """
    if isinstance(t, np.ndarray):
        return t
    if _tensor.is_tensor(t):
        device = getattr(getattr(t, "device", None), "type", "cpu")
        if device != "cpu":
            raise UnsupportedError(
                f"plait's Ray backend: {what}: the tensor is on {device}; plait serves CPU tensors"
            )
        try:
            return _tensor.as_array(t, f"plait's Ray backend: {what}: the tensor", UnsupportedError)
        except TypeError as exc:  # a dtype numpy cannot hold
            raise UnsupportedError(str(exc)) from exc
    raise UnsupportedError(
        f"plait's Ray backend: {what}: expected a numpy array or a CPU torch tensor, "
        f"got {type(t).__name__}"
    )


def _views(tensor_lists: Any, size: int, like: np.ndarray[Any, Any], what: str) -> list[Any]:
    """Ray's ``[[t0, …, t(size-1)]]`` as numpy views, each shaped and typed like ``like``."""
    parts = [_view(t, what) for t in _one(tensor_lists, what)]
    if len(parts) != size:
        raise ValueError(f"plait's Ray backend: {what}: expected {size} tensors, got {len(parts)}")
    for i, p in enumerate(parts):
        if p.shape != like.shape or p.dtype != like.dtype:
            raise ValueError(
                f"plait's Ray backend: {what}: tensor {i} is {p.dtype}{list(p.shape)}, "
                f"expected {like.dtype}{list(like.shape)}"
            )
    return parts


def _first(t: Any, n: int, what: str) -> Any:
    """The first ``n`` elements of ``t`` (Ray's n_elements; 0: ``t`` itself).

    A view of them where ``t`` is contiguous, else a copy (``reshape(-1)`` of a
    non-contiguous array is one), which ``recv`` writes back with
    :func:`_put_first`: a receive into the copy alone would vanish.
    """
    if not n:
        return t
    view = _view(t, what)
    if n > view.size:
        raise ValueError(f"plait's Ray backend: {what}: n_elements={n} > {view.size}")
    return view.reshape(-1)[:n]


def _put_first(t: Any, part: Any, what: str) -> None:
    """Write ``part``, received for ``t``'s first elements, into ``t`` unless it is a view of it."""
    view = _view(t, what)
    if part is t or np.may_share_memory(view, part):
        return
    view.flat[: part.size] = part


class PlaitGroup(BaseGroup):  # type: ignore[misc]  # Ray's classes are Any to mypy
    """A Ray collective group run by a plait :class:`~plait.Communicator`.

    Made by Ray for ``backend="plait"`` (see Note [how Ray calls a collective
    group]); creating it is a collective call of all ``world_size`` members,
    which meet through Ray's key-value store (Note [one incarnation of a Ray
    group]). Every call blocks until done and fails, never hangs: a member
    that dies makes the others raise :class:`plait.PeerLostError`.

    Args:
        world_size: the number of members.
        rank: this member's rank.
        group_name: the group's name (one key-value namespace per name).
        timeout: seconds for creating the group and default per call
            (PLAIT_TIMEOUT, else 300); Ray's ``timeout_ms`` options override
            it per call.

    Attributes:
        communicator: the plait communicator, for what Ray lacks: gather,
            scatter, alltoall, the object collectives, ``split``, ….
    """

    def __init__(
        self, world_size: int, rank: int, group_name: str, timeout: float | None = None
    ) -> None:
        super().__init__(world_size, rank, group_name)
        import ray

        seconds = default_timeout() if timeout is None else check_timeout(timeout, "timeout")
        context = ray.get_runtime_context()
        job = str(context.get_job_id())
        adopt_secret(RayKeyValue(job_namespace(job)))
        host = str(getattr(context, "gcs_address", "") or "").rpartition(":")[0].strip("[]")
        kv = RayKeyValue(group_namespace(job, group_name))
        self._meeting: Meeting
        self.communicator: plait.Communicator
        self._meeting, self.communicator = create(
            kv, rank, world_size, group_name, seconds, host=host or None
        )

    def __repr__(self) -> str:
        return f"<plait.ray.PlaitGroup {self.group_name!r} rank {self.rank} of {self.world_size}>"

    @classmethod
    def backend(cls) -> str:
        """The backend's name in Ray, ``"PLAIT"``."""
        return BACKEND_NAME

    @classmethod
    def check_backend_availability(cls) -> bool:
        """Always: plait needs nothing beyond numpy."""
        return True

    def destroy_group(self) -> None:
        """Close the communicator; delete what is left of the incarnation's keys. Local.

        Any member may delete them, rank 0 or not (it may be the one that died):
        Note [the keys of a finished incarnation] in :mod:`plait.ray._rendezvous`.
        """
        self.communicator.close()
        self._meeting.forget()

    # -- Ray's collectives (argument names are Ray's) -------------------------------------------
    def allreduce(self, tensor: Any, allreduce_options: Any = None) -> None:
        """Reduce every member's tensor into each, in place."""
        t = _one(tensor, "allreduce")
        self.communicator.allreduce(
            t, _op(allreduce_options), out=t, timeout=_seconds(allreduce_options)
        )

    def barrier(self, barrier_options: Any = None) -> None:
        """Return once every member has called it.

        ``ray.util.collective.barrier`` passes no options, where the other calls
        pass their options class (``types.AllReduceOptions``, …) with its class
        attributes set; so without options the barrier reads
        ``types.BarrierOptions``, whose ``timeout_ms`` then overrides
        PLAIT_TIMEOUT as the other calls' do (Note [how Ray calls a collective
        group]).
        """
        options = types.BarrierOptions if barrier_options is None else barrier_options
        self.communicator.barrier(timeout=_seconds(options))

    def reduce(self, tensor: Any, reduce_options: Any = None) -> None:
        """Reduce every member's tensor into the root's, in place; others stay unchanged."""
        t = _one(tensor, "reduce")
        root = int(getattr(reduce_options, "root_rank", 0))
        self.communicator.reduce(
            t, root, _op(reduce_options), out=t, timeout=_seconds(reduce_options)
        )

    def broadcast(self, tensor: Any, broadcast_options: Any = None) -> None:
        """Copy the root's tensor into every member's, in place."""
        t = _one(tensor, "broadcast")
        root = int(getattr(broadcast_options, "root_rank", 0))
        self.communicator.broadcast(t, root, timeout=_seconds(broadcast_options))

    def allgather(self, tensor_list: Any, tensor: Any, allgather_options: Any = None) -> None:
        """Write member r's tensor into ``tensor_list[r]`` on every member."""
        x = _view(_one(tensor, "allgather"), "allgather")
        outs = _views(tensor_list, self.world_size, x, "allgather")
        gathered = np.empty((self.world_size, *x.shape), x.dtype)
        self.communicator.allgather(x, out=gathered, timeout=_seconds(allgather_options))
        for out, row in zip(outs, gathered, strict=True):
            np.copyto(out, row)

    def reducescatter(
        self, tensor: Any, tensor_list: Any, reducescatter_options: Any = None
    ) -> None:
        """Member r gets the reduction over members of their ``tensor_list[r]``, in ``tensor``.

        plait's own reduce-scatter: each member sends and receives about one
        list's worth of data, where Ray's gloo group runs one all-reduce per
        member. The input list is left unchanged.
        """
        out = _view(_one(tensor, "reducescatter"), "reducescatter")
        parts = _views(tensor_list, self.world_size, out, "reducescatter")
        stacked = np.stack(parts)
        target = out.reshape((1, *out.shape)) if out.flags.c_contiguous else None
        result = self.communicator.reduce_scatter(
            stacked, _op(reducescatter_options), out=target, timeout=_seconds(reducescatter_options)
        )
        if target is None:
            np.copyto(out, result[0])

    def send(self, tensor: Any, send_options: Any = None) -> None:
        """Send the tensor to ``send_options.dst_rank`` (blocks until it is sent)."""
        t = _first(_one(tensor, "send"), int(getattr(send_options, "n_elements", 0)), "send")
        dst = int(getattr(send_options, "dst_rank", 0))
        self.communicator.send(t, dst, timeout=_seconds(send_options))

    def recv(self, tensor: Any, recv_options: Any = None) -> None:
        """Receive into the tensor from ``recv_options.src_rank``, in place."""
        t = _one(tensor, "recv")
        part = _first(t, int(getattr(recv_options, "n_elements", 0)), "recv")
        src = int(getattr(recv_options, "src_rank", 0))
        self.communicator.recv(part, src, timeout=_seconds(recv_options))
        _put_first(t, part, "recv")
