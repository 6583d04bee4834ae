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
       came, and deletes the arrived keys it saw;
    3. every other rank waits up to the timeout for ``arrived/0`` (else it
       raises CommTimeout naming rank 0), then up to the timeout for
       ``release`` (and a few seconds' grace): rank 0 writes it at most a
       timeout after it arrived, and this rank saw it arrive. Having read it,
       it sets ``read/<rank>``;
    4. rank 0 waits for the ``read`` key of every rank that arrived (up to the
       timeout, and at least the grace) before it returns or raises;
    5. every rank that reads a non-empty list raises CommTimeout naming
       those ranks.

    Step 4 is why rank 0 cannot leave first: under ``plait run``, ``env://``
    and ``tcp://`` rank 0 serves the store, so a rank 0 that returned at once
    and destroyed its group as its next call took the store with it while
    the others still waited for the verdict (gloo's monitored barrier
    likewise has rank 0 answer every rank before it returns). A rank that
    meets a failing store instead (a store served by a rank that died) raises
    RendezvousError saying which step failed, not the store's own error.

    So rank 0 names every rank that did not arrive within the timeout of its
    own arrival (gloo names only the first unless ``wait_all_ranks=True``;
    here the list is complete either way), every other rank learns the same
    list, and a missing rank 0 is named by every other rank. A rank waits at
    most twice the timeout and the grace (rank 0's arrival, then its verdict;
    rank 0: the arrivals, then the reads).

    The keys of a barrier are deleted once every rank has read its verdict.
    Those of one that a rank missed (or did not read in time) stay for that
    rank to read when it comes late, until a later barrier that every rank
    came to and read (each rank has then finished the earlier ones).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence

from plait.errors import CommTimeout, RendezvousError, UnsupportedError
from plait.rendezvous.store import Store, StoreTimeout

__all__ = ["MonitoredBarrier"]

_PREFIX = "plait-torch/monitored"
#: The shortest wait asked of the store (a zero timeout means "none" to some stores).
_MIN_WAIT = 1e-3
#: Seconds a rank waits for rank 0's verdict beyond the timeout: rank 0 checks the
#: missing keys and writes the verdict after its own timeout ran out. Also the least
#: rank 0 waits for the ranks that arrived to read it (they read it at once).
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
        #: Rank 0's barriers whose verdict some rank has not read: their keys stay for it
        #: (the barrier's number -> those ranks).
        self._kept: dict[int, list[int]] = {}

    def _names(self, ranks: Sequence[int]) -> str:
        text = f"rank(s) {list(ranks)}"
        if self._global != list(range(self._size)):
            text += f" (global rank(s) {[self._global[r] for r in ranks]})"
        return text

    def _me(self) -> str:
        if self._global == list(range(self._size)):
            return f"rank {self._rank}: monitored_barrier"
        return f"rank {self._rank} (global rank {self._global[self._rank]}): monitored_barrier"

    def wait(self, timeout: float) -> None:
        """Return once every rank has arrived; else CommTimeout naming those that did not.

        Raises:
            CommTimeout: a rank did not arrive within ``timeout`` s (named), or
                rank 0 did not release this rank in time.
            RendezvousError: the store failed (its server gone with the rank that
                served it); the message says at which step.
            UnsupportedError: the group was made without a store.
        """
        store = self._store
        if store is None:
            raise UnsupportedError(
                f"{self._me()}: the group was made without a store to meet through"
            )
        n = self._count
        self._count += 1
        if self._rank == 0:
            self._lead(store, n, timeout)
        else:
            self._follow(store, n, timeout)

    @contextlib.contextmanager
    def _step(self, n: int, what: str) -> Iterator[None]:
        """Turn a failure of the store in ``what`` into RendezvousError (timeouts pass)."""
        try:
            yield
        except CommTimeout:
            raise
        except Exception as exc:
            said = (str(exc).strip().splitlines() or [""])[0]
            raise RendezvousError(
                f"{self._me()}: barrier #{n}: the store the group's ranks meet through failed "
                f"while {what} ({type(exc).__name__}: {said}); where rank 0 serves it "
                "(plait run, env://, tcp://), rank 0 has exited or died"
            ) from exc

    def _lead(self, store: Store, n: int, timeout: float) -> None:
        """Rank 0's part: collect the arrivals, give the verdict, wait until it is read."""
        base = f"{_PREFIX}/{n}"
        with self._step(n, "arriving"):
            store.set(f"{base}/arrived/0", b"1")
        with self._step(n, "waiting for the other ranks"):
            missing = self._collect(store, base, timeout)
        with self._step(n, "giving the verdict"):
            store.set(f"{base}/release", json.dumps(missing).encode())
        came = [r for r in range(1, self._size) if r not in missing]
        reads = {r: f"{base}/read/{r}" for r in came}
        wait = max(timeout, _GRACE)
        with self._step(n, "waiting for the verdict to be read"):
            if reads:
                with contextlib.suppress(StoreTimeout):  # the ones that did not are named below
                    store.wait(list(reads.values()), wait)
            unread = [r for r, key in reads.items() if not store.check([key])]
        self._tidy(store, n, base, missing + unread, [r for r in came if r not in unread])
        problems = []
        if missing:
            problems.append(f"{self._names(missing)} did not arrive within {timeout:g} s")
        if unread:
            problems.append(
                f"{self._names(unread)} arrived but did not read the verdict within "
                f"{wait:g} s: they may have died"
            )
        if problems:
            raise CommTimeout(f"{self._me()}: {'; '.join(problems)} (barrier #{n})")

    def _follow(self, store: Store, n: int, timeout: float) -> None:
        """Another rank's part: arrive, wait for rank 0, read its verdict and say so."""
        me = self._me()
        base = f"{_PREFIX}/{n}"
        with self._step(n, "arriving"):
            store.set(f"{base}/arrived/{self._rank}", b"1")
        try:
            with self._step(n, "waiting for rank 0 to arrive"):
                store.wait([f"{base}/arrived/0"], max(timeout, _MIN_WAIT))
        except StoreTimeout:
            raise CommTimeout(
                f"{me}: {self._names([0])} did not arrive within {timeout:g} s (barrier #{n})"
            ) from None
        try:  # rank 0 has arrived: it releases within its own timeout from then
            with self._step(n, "reading rank 0's verdict"):
                raw = store.get(f"{base}/release", timeout + _GRACE)
        except StoreTimeout:
            raise CommTimeout(
                f"{me}: rank 0 arrived but gave no verdict on barrier #{n} within "
                f"{timeout + _GRACE:g} s: it may have died"
            ) from None
        with self._step(n, "saying it read rank 0's verdict"):
            store.set(f"{base}/read/{self._rank}", b"1")
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

    def _tidy(self, store: Store, n: int, base: str, late: list[int], read: list[int]) -> None:
        """Rank 0: delete the keys no rank will read again (Note [monitored barrier]).

        A barrier whose verdict some rank has not read (``late``: it did not
        arrive, or not read in time) keeps it for that rank until a barrier
        that every rank came to and read; then every rank has finished the
        earlier one, and its keys go. ``read``: the ranks that read it.
        """
        if late:
            self._kept[n] = late
        keys = [f"{base}/read/{r}" for r in read]
        if not late:
            keys += [f"{base}/release", f"{base}/arrived/0"]
            for m, late in self._kept.items():
                keys += [f"{_PREFIX}/{m}/{k}" for k in ("release", "arrived/0")]
                keys += [f"{_PREFIX}/{m}/{k}/{r}" for r in late for k in ("arrived", "read")]
            self._kept.clear()
        for key in keys:
            with contextlib.suppress(Exception):
                store.delete(key)
