"""A communicator in a child made by ``os.fork``: refused, and left to its parent.

Note [communicators after fork]
    A child made by ``fork`` inherits the parent's communicators: their sockets, shared
    memory, epoll instance and store connection are the parent's too (the same kernel
    objects). A child that used one took part in its parent's calls (ranks then disagreed
    on the results, with no error), and its ``close()`` unregistered the parent's
    descriptors from the shared epoll instance and told the peers it had closed. So in the
    child every communicator made before the fork is broken with :class:`ForkedError`: a
    call raises it, naming the process it belongs to, and ``close()`` (a ``with`` block's
    end, the exit) only marks it closed, touching nothing the parent still uses. A
    communicator for the child is a new ``plait.init`` there.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from plait.errors import ForkedError

__all__ = ["not_forked", "watch"]


#: Every live communicator's call runner: the process that made it, and its rank.
_RUNNERS: weakref.WeakKeyDictionary[Any, tuple[int, int]] = weakref.WeakKeyDictionary()


def watch(runner: Any, rank: int) -> None:
    """Break ``runner`` (rank ``rank``'s) in any child this process forks from now on."""
    _RUNNERS[runner] = (os.getpid(), rank)


def not_forked(runner: Any, what: str) -> None:
    """Raise ForkedError where ``runner``'s communicator is its parent's (this process is a
    child made by fork): what would drive its transport or store (a request's wait, abort,
    agree, shrink) acted on the parent's job; None: nothing to check."""
    if runner is not None and isinstance(runner.broken, ForkedError):
        runner.check_usable(what)


def _in_child() -> None:
    for runner, (pid, rank) in list(_RUNNERS.items()):
        runner.broken = ForkedError(
            f"rank {rank}: this communicator belongs to process {pid}; a child made by "
            "fork cannot use it (its memory, sockets and store connection are the "
            "parent's): call plait.init in the child for one of its own"
        )


os.register_at_fork(after_in_child=_in_child)
