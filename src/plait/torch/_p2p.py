"""Point to point of a plait process group: ``dist.send`` / ``recv`` and their async forms.

:class:`PointToPoint` is a mixin of
:class:`~plait.torch._backend.ProcessGroupPlait`: these calls do not run on
plait's collective worker nor count as collectives, and share only the
group's communicator and its coalescing block with the rest.

Note [point to point on lanes]
    A send runs plait's blocking ``send`` on a lane, one per (send, peer,
    tag): its calls run one after the other on a thread of its own while it
    has any, which keeps the messages to one peer with one tag in order and
    never lets a send blocked until its peer receives hold up anything else.

    A receive is *posted* on the caller's thread, in program order, with
    plait's non-blocking ``irecv`` (the tensor's memory is the receive
    buffer; for a tensor off the CPU, a host buffer written back into it
    before the work completes: Note [tensors on a GPU] in
    ``plait.torch._staging``), and *waited for* on a lane, one per (recv,
    source or "any", tag), which completes the work and its future by
    itself (DDP and ``get_future()`` users never call ``wait()``) and gives
    up at the communicator's deadline, withdrawing the receive so it never
    writes into the tensor afterwards. Which lane waits decides nothing
    about which message a receive gets: the posting order does (Note
    [receive from any source]).

    A lane ends once it has nothing to run, and its thread goes on to
    another lane or ends soon after (Note [lanes that end] in
    ``plait.torch._work``), so a new tag for every message costs no thread
    that outlives its messages.

Note [receive from any source]
    ``dist.recv(t)`` and ``dist.irecv(t)`` without ``src`` call
    ``recv_anysource``, which posts ``irecv(src=plait.ANY_SOURCE, tag)``.
    plait's transport matches a message to the earliest-posted receive that
    accepts it, specific-source and any-source alike, and keeps the messages
    of one sender with one tag in order (MPI's rules). Posting every receive
    on the caller's thread makes that posting order the program's order, so
    an any-source receive neither overtakes a specific-source receive called
    before it on the same tag nor is overtaken by one called after it. Had
    receives been posted from their lanes, as sends are run, two lanes could
    post in either order and a receive could take the message an earlier one
    was due.

    The work's ``source_rank()`` (torch's ``_source_rank()``) is the sender's
    rank in the group once the receive is done, -1 before (as gloo's);
    ``dist.recv`` turns it into a global rank. A receive from any source
    fails for a lost peer only once every other rank of the group is lost
    (plait's rule); its deadline bounds it anyway. torch 2.13's
    ``recv_object_list`` refuses ``src=None`` itself ("Must specify
    global_rank or group_rank"), for every backend, before the group is asked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import plait
from plait.errors import CommError, CommTimeout
from plait.torch._convert import array, check_one, check_peer, check_tag, output_array
from plait.torch._staging import Staged, then_write_back
from plait.torch._work import Lanes, PlaitWork, Task

__all__ = ["PointToPoint"]


class PointToPoint:
    """Send and receive of a plait process group (a mixin; Notes above)."""

    _comm: plait.Communicator
    _lanes: Lanes
    _lock: threading.Lock
    _down: bool
    _globals: list[int] | None  # a sub-group's global ranks, for its errors

    if TYPE_CHECKING:  # provided by ProcessGroupPlait

        def _describe(self, call: str) -> str: ...

        def _named(self, exc: BaseException) -> BaseException: ...

        def _track(self, work: PlaitWork) -> PlaitWork: ...

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> PlaitWork:
        """``dist.send`` / ``isend``: the tensor to rank ``dstRank`` (on a lane, see the Note)."""
        c = "send"
        t = check_one(tensors, c)
        a = array(t, c, "tensor")
        dst = check_peer(dstRank, self._comm.rank, self._comm.size, c, "dst")
        tag = check_tag(tag, c)
        comm = self._comm
        task = self._submit(
            "send", dst, tag, f"send to rank {dst} (tag {tag})", lambda: comm.send(a, dst, tag)
        )
        return self._track(
            PlaitWork(
                self._describe(c), [task], [t], timeout=comm.timeout, global_ranks=self._globals
            )
        )

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> PlaitWork:
        """``dist.recv`` / ``irecv``: the next message from ``srcRank`` with ``tag``."""
        c = "recv"
        t = check_one(tensors, c)
        back: list[Staged] = []
        a = output_array(t, c, "tensor", back, contents=False)
        src = check_peer(srcRank, self._comm.rank, self._comm.size, c, "src")
        return self._receive(c, t, a, src, check_tag(tag, c), back)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> PlaitWork:
        """``dist.recv`` / ``irecv`` without ``src``: the next message with ``tag`` from any rank.

        The work's ``source_rank()`` names the sender (Note [receive from any source]).
        """
        c = "recv"
        t = check_one(tensors, c)
        back: list[Staged] = []
        a = output_array(t, c, "tensor", back, contents=False)
        return self._receive(c, t, a, plait.ANY_SOURCE, check_tag(tag, c), back)

    def send_object(self, obj: Any, dst: int) -> None:
        """``dist.send_object_list``: plait's ``send_object`` to ``dst`` (tag 0), done here.

        It runs on the send lane of (``dst``, tag 0), the one ``dist.send``
        uses, so that it follows every earlier send to ``dst`` on that tag;
        this waits for it (its own deadlines bound it) and raises its error.
        """
        dst = check_peer(dst, self._comm.rank, self._comm.size, "send_object_list", "dst")
        comm = self._comm
        task = self._submit(
            "send", dst, 0, f"send_object_list to rank {dst}", lambda: comm.send_object(obj, dst)
        )
        try:
            task.wait()
        except CommError as exc:
            raise self._named(exc)  # noqa: B904 - chained by globally_named()

    def _receive(
        self, c: str, t: torch.Tensor, a: np.ndarray, src: int, tag: int, back: list[Staged]
    ) -> PlaitWork:
        """Post the receive here, wait for it on its lane (Note [point to point on lanes]).

        ``back``: ``t`` and its host buffer ``a`` when ``t`` is off the CPU;
        the work writes ``a`` into ``t`` once the message is in.
        """
        comm = self._comm
        who = "any rank" if src == plait.ANY_SOURCE else f"rank {src}"
        self._open()  # first: a group that is shut down posts nothing
        try:
            req = comm.irecv(a, src, tag)
        except CommError as exc:  # posted here: named as a group's errors are, as sends' are
            raise self._named(exc)  # noqa: B904 - chained by globally_named()
        task = self._submit(
            "recv", src, tag, f"recv from {who} (tag {tag})", lambda: _received(req, comm.timeout)
        )
        source: int | Callable[[], int] = src if src != plait.ANY_SOURCE else _sender(task)
        return self._track(
            PlaitWork(
                self._describe(c),
                [task],
                [t],
                finish=then_write_back(None, back) if back else None,
                timeout=comm.timeout,
                source_rank=source,
                global_ranks=self._globals,
            )
        )

    def _open(self) -> None:
        """Raise ClosedError if the group is shut down."""
        if self._down:
            raise plait.ClosedError(f"rank {self._comm.rank}: the process group is shut down")

    def _submit(
        self, direction: str, peer: int, tag: int, call: str, fn: Callable[[], Any]
    ) -> Task:
        """Run ``fn`` on the lane of (``direction``, ``peer``, ``tag``) after its earlier calls.

        The lane exists while it has calls to run (Note [lanes that end] in
        ``plait.torch._work``). Under the group's lock, so that nothing is
        submitted once :meth:`shutdown` has begun to stop the lanes.
        """
        with self._lock:
            self._open()
            return self._lanes.submit((direction, peer, tag), self._describe(call), fn)


def _received(req: plait.Request[Any], seconds: float) -> int:
    """Wait for the posted receive ``req`` at most ``seconds``; the sender's rank.

    At the deadline the receive is withdrawn, so that it never writes into
    the tensor later, and the timeout raised; one that matched a message
    just then cannot be withdrawn, and gets one more deadline to finish.
    """
    try:
        req.wait(seconds)
    except CommTimeout:
        if req.done():  # the receive's own failure, not wait()'s deadline
            raise
        req.cancel()
        if req.cancelled:
            raise
        req.wait(seconds)
    status = req.status
    assert status is not None  # done
    return status.source


def _sender(task: Task) -> Callable[[], int]:
    """The rank an any-source receive got its message from, once done (-1 before, or failed)."""

    def source() -> int:
        if not task.done():
            return -1
        try:
            return int(task.wait(0))
        except Exception:
            return -1

    return source
