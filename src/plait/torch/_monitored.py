"""A barrier that names the ranks that did not arrive: ``monitored_barrier`` for plait.

Note [monitored barrier]
    torch reserves ``dist.monitored_barrier`` for gloo (it raises ValueError
    for any other backend before asking the group), so the plait backend
    offers the same safety as :func:`plait.torch.monitored_barrier` and
    ``ProcessGroupPlait.monitored_barrier``. It meets through the store the
    group's ranks met through (torch's, in the group's namespace), not
    through the communicator: a rank that never comes leaves no call half
    done on the connections, so the group stays usable after the error.

    The n-th monitored barrier of a group uses the keys
    ``plait-torch/monitored/<n>/...``:

    1. every rank sets ``arrived/<rank>``;
    2. rank 0 waits up to the timeout for every other ``arrived`` key, then
       writes ``release``: the ranks whose key is missing (JSON), none if all
       came. It deletes the keys of the barrier before (every rank read them
       before it could arrive at this one) and the arrived keys it saw;
    3. every other rank waits up to the timeout for ``arrived/0`` (else it
       raises CommTimeout naming rank 0), then up to the timeout for
       ``release`` (and a few seconds' grace): rank 0 writes it at most a
       timeout after it arrived, and this rank saw it arrive;
    4. every rank that reads a non-empty list raises CommTimeout naming
       those ranks.

    So rank 0 names every rank that did not arrive within the timeout of its
    own arrival (gloo names only the first unless ``wait_all_ranks=True``;
    here the list is complete either way), every other rank learns the same
    list, and a missing rank 0 is named by every other rank. A rank waits at
    most twice the timeout and the grace (rank 0's arrival, then its verdict).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence

from plait.errors import CommTimeout, UnsupportedError
from plait.rendezvous.store import Store, StoreTimeout

__all__ = ["MonitoredBarrier"]

_PREFIX = "plait-torch/monitored"
#: The shortest wait asked of the store (a zero timeout means "none" to some stores).
_MIN_WAIT = 1e-3
#: Seconds a rank waits for rank 0's verdict beyond the timeout: rank 0 checks the
#: missing keys and writes the verdict after its own timeout ran out.
_GRACE = 5.0


class MonitoredBarrier:
    """The monitored barriers of one group, numbered in call order (Note [monitored barrier]).

    Args:
        store: the store the group's ranks met through; None: unsupported.
        rank: this rank in the group.
        size: the group's size.
        global_ranks: the default group's rank of each member (for messages).
    """

    def __init__(
        self, store: Store | None, rank: int, size: int, global_ranks: Sequence[int]
    ) -> None:
        self._store = store
        self._rank = rank
        self._size = size
        self._global = list(global_ranks)
        self._count = 0

    def _names(self, ranks: Sequence[int]) -> str:
        text = f"rank(s) {list(ranks)}"
        if self._global != list(range(self._size)):
            text += f" (global rank(s) {[self._global[r] for r in ranks]})"
        return text

    def wait(self, timeout: float) -> None:
        """Return once every rank has arrived; else CommTimeout naming those that did not.

        Raises:
            CommTimeout: a rank did not arrive within ``timeout`` s (named), or
                rank 0 did not release this rank in time.
            UnsupportedError: the group was made without a store.
        """
        store = self._store
        me = f"rank {self._rank}: monitored_barrier"
        if store is None:
            raise UnsupportedError(f"{me}: the group was made without a store to meet through")
        n = self._count
        self._count += 1
        base = f"{_PREFIX}/{n}"
        release = f"{base}/release"
        if self._rank == 0:
            store.set(f"{base}/arrived/0", b"1")
            missing = self._collect(store, base, timeout)
            store.set(release, json.dumps(missing).encode())
            if n:  # every rank has read these before it could arrive here
                for key in ("release", "arrived/0"):
                    with contextlib.suppress(Exception):
                        store.delete(f"{_PREFIX}/{n - 1}/{key}")
            if missing:
                raise CommTimeout(
                    f"{me}: {self._names(missing)} did not arrive within {timeout:g} s "
                    f"(barrier #{n})"
                )
            return
        store.set(f"{base}/arrived/{self._rank}", b"1")
        try:
            store.wait([f"{base}/arrived/0"], max(timeout, _MIN_WAIT))
        except StoreTimeout:
            raise CommTimeout(
                f"{me}: {self._names([0])} did not arrive within {timeout:g} s (barrier #{n})"
            ) from None
        try:  # rank 0 has arrived: it releases within its own timeout from then
            raw = store.get(release, timeout + _GRACE)
        except StoreTimeout:
            raise CommTimeout(
                f"{me}: rank 0 arrived but gave no verdict on barrier #{n} within "
                f"{timeout + _GRACE:g} s: it may have died"
            ) from None
        missing = json.loads(raw)
        if missing:
            raise CommTimeout(
                f"{me}: rank 0 reports that {self._names(missing)} did not arrive within its "
                f"timeout (barrier #{n})"
            )

    def _collect(self, store: Store, base: str, timeout: float) -> list[int]:
        """Rank 0's part: wait for every other rank's key; the ranks whose key is missing."""
        keys = {r: f"{base}/arrived/{r}" for r in range(1, self._size)}
        if not keys:
            return []
        with contextlib.suppress(StoreTimeout):  # the missing ones are named below
            store.wait(list(keys.values()), max(timeout, _MIN_WAIT))
        missing = [r for r, key in keys.items() if not store.check([key])]
        for r, key in keys.items():
            if r not in missing:
                with contextlib.suppress(Exception):
                    store.delete(key)
        return missing
