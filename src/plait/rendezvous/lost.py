"""Ranks a launcher saw die, filed in the store, so that start-up waits end at once.

Note [lost ranks]
    After start-up a dead peer shows as a closed connection or a stopped
    counter within a fraction of a second. During ``plait.init`` a rank that
    dies before it has published anything leaves only a key that never
    appears: the others would wait for it until the init deadline (300 s by
    default). A launcher that keeps the others running after a rank is
    killed (``plait run --enable-recovery``) knows better, and says so in
    the job's store: :func:`report_lost` sets ``plait/lost/<rank>`` to how
    the rank ended, then adds 1 to ``plait/lost`` (in that order, so that a
    count above zero always finds its reasons). Ranks are the job's ranks
    (``PLAIT_RANK``), the keys sit at the store's root, outside every
    :class:`~plait.rendezvous.store.PrefixStore`, and each attempt of a job
    has a new store, so a notice never outlives the rank's attempt.

    Only the job's own ranks look: ``plait.init`` under ``plait run`` meets
    in a :class:`JobRanks` namespace, where rank ``r`` is job rank ``r``;
    a shrunk communicator's ranks are renumbered and never look.
    A start-up wait for other ranks' keys (:func:`wait_ranks`) waits in
    slices of :data:`LOOK_SECONDS`; between two slices one ``check`` of
    ``plait/lost`` says whether any rank was filed at all, and only then is
    each awaited rank looked up. So a wait costs one store round trip per
    second more than a plain ``wait``, and a rank filed lost ends it within
    about a second, with a :class:`~plait.errors.PeerLostError` naming it.
    Without such a launcher (torchrun, mpirun, a store passed in) nothing is
    ever filed and the waits end at their deadline, as before.

    A :class:`Watched` namespace is the other kind a wait looks in: its owner
    tells which of its ranks are dead by a function, asked between two slices
    (a shrunk communicator's set-up: Note [survivors that die] in
    plait._liveness).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from plait.errors import PeerLostError
from plait.rendezvous.store import PrefixStore, Store, StoreTimeout

__all__ = [
    "LOOK_SECONDS",
    "JobRanks",
    "Watched",
    "filed",
    "lost_error",
    "report_lost",
    "root",
    "wait_ranks",
]

#: Seconds a start-up wait runs between two looks for ranks filed lost.
LOOK_SECONDS = 1.0

_COUNT = "plait/lost"


def _key(rank: int) -> str:
    return f"{_COUNT}/{rank}"


class JobRanks(PrefixStore):
    """A namespace of the store in which rank ``r`` is the job's rank ``r``.

    Start-up waits through it, or through a view of it, look for ranks filed
    lost (Note [lost ranks]); waits through any other store (a shrunk
    communicator's, whose ranks are renumbered) do not.
    """


class Watched(PrefixStore):
    """A namespace whose ranks' deaths ``dead`` tells: given ranks, those that died and how.

    ``during`` names what the waits in it are part of ("shrink"), for their errors.
    """

    def __init__(
        self,
        prefix: str,
        store: Store,
        dead: Callable[[Sequence[int]], dict[int, str]],
        during: str,
    ) -> None:
        super().__init__(prefix, store)
        self.dead = dead
        self.during = during


def _watched(store: Store) -> Watched | None:
    """The nearest :class:`Watched` view ``store`` is (or is a view of), else None."""
    view = store
    while isinstance(view, PrefixStore):
        if isinstance(view, Watched):
            return view
        if isinstance(view, JobRanks):
            return None
        view = view.store
    return None


def root(store: Store) -> Store:
    """The store under every :class:`PrefixStore` view of it (where notices are filed)."""
    while isinstance(store, PrefixStore):
        store = store.store
    return store


def _job_root(store: Store) -> Store | None:
    """The root of ``store`` if it is a view of a :class:`JobRanks` namespace, else None."""
    view = store
    while isinstance(view, PrefixStore):
        if isinstance(view, JobRanks):
            return root(view)
        view = view.store
    return None


def report_lost(store: Store, rank: int, how: str) -> None:
    """File job rank ``rank`` as dead (``how``: "killed by SIGKILL") for the ranks waiting on it."""
    base = root(store)
    base.set(_key(rank), how.encode())
    base.add(_COUNT, 1)  # after the reason: a count above zero always finds it


def filed(store: Store, ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` a launcher filed as dead, and how they ended.

    One round trip when none was; always empty for a store that is not a view of
    a :class:`JobRanks` namespace.
    """
    watched = _watched(store)
    if watched is not None:
        return watched.dead(ranks)
    base = _job_root(store)
    if base is None or not base.check([_COUNT]):
        return {}
    return {r: base.get(_key(r), 0.0).decode() for r in ranks if base.check([_key(r)])}


def lost_error(
    me: str, lost: dict[int, str], what: str, store: Store | None = None
) -> PeerLostError:
    """The error of a start-up wait that rank(s) ``lost`` will never end: they died.

    ``me`` starts the message ("rank 2"); ``what`` is what the dead ranks did not
    do ("announce their segment"); ``store``: the store of the wait (a
    :class:`Watched` one names what the wait was part of).
    """
    ranks = sorted(lost)
    how = "; ".join(f"rank {r} {lost[r]}" for r in ranks)
    watched = None if store is None else _watched(store)
    if watched is not None:
        text = f"died before they could {what} in {watched.during} ({how})"
    else:
        text = f"died before they could {what} in plait.init ({how}, as plait run saw)"
    err = PeerLostError(f"{me}: rank(s) {ranks} {text}: see their output")
    err.lost_rank = ranks[0]
    return err


def wait_ranks(
    store: Store,
    keys: Sequence[str],
    ranks: Sequence[int],
    timeout: float | None,
    *,
    me: str,
    what: str,
) -> None:
    """``store.wait(keys, timeout)``, where ``keys[i]`` is set by rank ``ranks[i]`` (of the
    job in a :class:`JobRanks` namespace, of the namespace's own in a :class:`Watched` one).

    Raises:
        PeerLostError: a launcher filed a rank whose key is missing as dead, or a
            Watched namespace says it died (Note [lost ranks]); within about
            :data:`LOOK_SECONDS`.
        StoreTimeout: some keys were still missing after ``timeout``.
    """
    seconds = store.timeout if timeout is None else timeout
    watched = _watched(store)
    base = _job_root(store) if watched is None else None
    if base is None and watched is None:
        store.wait(keys, seconds)
        return
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, max(min(left, LOOK_SECONDS), 0.0))
            return
        except StoreTimeout:
            if left <= LOOK_SECONDS:
                raise
        if base is not None and not base.check([_COUNT]):  # nobody filed: one round trip
            continue
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        lost = filed(store, missing)
        if lost:
            raise lost_error(me, lost, what, store)
