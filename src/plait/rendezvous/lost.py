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
    has a new store, so a notice never outlives the rank's attempt. A rank
    that exits before it joined ``plait.init`` is filed so too, with that
    option or without (Note [ranks that never joined]).

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

Note [a key set before a death]
    Waits of different ranks for the same keys must end alike (every survivor of a
    shrink waits for all to have connected, and returns only if all did). A rank that
    sets its key and then dies is seen as having set it by a wait that looks at the keys
    afterwards, and as one that never will by a wait that looked before, then found the
    rank dead. So a rank found dead, or given up, ends a wait only if its key is still
    missing when looked at again after that: a key set before the death is then found,
    and every wait ends alike.

Note [ranks that gave up]
    A rank alive is not always a rank that will set a key: one whose set-up failed (its
    shared-memory join met a dead rank of its host) raises, and a rank of another host
    that waits for its TCP address waited out its whole timeout, naming a live rank that
    "never published". So a rank whose set-up fails files that it gave up, and why
    (:func:`report_gave_up`), in the namespace a wait looks in: ``plait/lost/<rank>`` and
    the count ``plait/lost`` of the :class:`JobRanks` or :class:`Watched` view itself (not
    the store's root: a later ``plait.init`` of the job meets in a namespace of its own),
    its value starting with :data:`GAVE_UP`; a wait that finds it ends within about a
    second with a :class:`~plait.errors.RendezvousError` naming the rank and its reason.

Note [ranks that never joined]
    A rank whose script ends before it calls ``plait.init`` (``if rank == 2:
    sys.exit(0)``, an early return on one rank) dies of nothing: it exits, often with 0,
    and the others wait for its key until the init deadline, as for a rank killed. So
    ``plait run`` files every rank that exits by itself (any code) while others still
    run, if it had not joined the job's first ``plait.init``: it has not claimed its rank
    there (:func:`joined`), and its value says so (``exited with code 0 before calling
    plait.init``); on several hosts, even as the last of its host to exit, since other
    hosts' ranks may wait for it. A rank that has claimed is never filed this way,
    whatever the others still do: it has set, or is setting, the keys of its init, and
    ranks finish at different times (one may return from ``init`` and exit while a peer
    still reads its TCP handshake, which a look for ranks filed lost, between two slices,
    must not cut short). A rank filed this way is a cause the launcher can name: the others' waits
    raise :class:`~plait.errors.PeerLostError` naming it, and the launcher names it as
    the rank that started the failure (:func:`plait.launch.watch.watch`). Only its own
    launcher saw it exit: a launcher of another host whose ranks failed of it finds it
    here (:meth:`plait.launch.job._Filer.left_elsewhere`) and files it, not its own rank,
    as the cause the hosts settle on (Note [which host started a failure] in
    plait.launch.elsewhere); its own launcher, whose ranks may all have ended with 0,
    waits for that verdict (:meth:`plait.launch.elsewhere.Elsewhere.outcome`).

    A rank that claims its rank in a ``plait.init`` meeting in the launcher's store (a
    :class:`JobRanks` namespace) says so at the store's root, ``plait/joined/<rank>``
    (:func:`mark_joined`), whichever ``init`` of its process that is: one whose first
    ``init`` met elsewhere (the torch backend meets in torch's store) and a later one here
    is a rank that joined, not one that never started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from plait.errors import CommError, PeerLostError, RendezvousError
from plait.rendezvous.store import PrefixStore, Store, StoreTimeout

__all__ = [
    "COUNT",
    "GAVE_UP",
    "LOOK_SECONDS",
    "JobRanks",
    "Watched",
    "filed",
    "joined",
    "lost_count",
    "lost_error",
    "mark_joined",
    "report_gave_up",
    "report_lost",
    "reports",
    "root",
    "wait_ranks",
]

#: Seconds a start-up wait runs between two looks for ranks filed lost.
LOOK_SECONDS = 1.0

_COUNT = "plait/lost"
#: The key that counts the ranks filed lost (set at the first).
COUNT = _COUNT
#: How a rank filed by :func:`report_gave_up` ended, before its reason.
GAVE_UP = "gave up its set-up: "
#: The most characters of a reason filed.
_REASON_CHARS = 2000


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

    ``during`` names what the waits in it are part of ("shrink"), for their errors;
    ``members``, where its ranks had other numbers before (a shrink's survivors).
    """

    def __init__(
        self,
        prefix: str,
        store: Store,
        dead: Callable[[Sequence[int]], dict[int, str]],
        during: str,
        members: Sequence[int] | None = None,
    ) -> None:
        super().__init__(prefix, store)
        self.dead = dead
        self.during = during
        self.members = members  # each rank's number before (a shrink renumbers), or None


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


def _job_view(store: Store) -> JobRanks | None:
    """The :class:`JobRanks` namespace ``store`` is (or is a view of), else None."""
    view = store
    while isinstance(view, PrefixStore):
        if isinstance(view, JobRanks):
            return view
        view = view.store
    return None


def report_gave_up(store: Store, rank: int, reason: str) -> None:
    """File that rank ``rank`` of the set-up waiting in ``store`` gave up, and why, where the
    others' waits look (Note [ranks that gave up]); nothing where they do not look. Best
    effort: the store may be what failed."""
    view: Store | None = _watched(store) or _job_view(store)
    if view is None:
        return
    text = (GAVE_UP + reason[:_REASON_CHARS]).encode(errors="backslashreplace")
    try:
        view.set(_key(rank), text)
        view.add(_COUNT, 1)
    except (CommError, OSError):
        pass


def _gave_up(view: Store, ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` filed in ``view`` that they gave up, and why."""
    if not view.check([_COUNT]):
        return {}
    # Read as text whatever a store holds: an error here would not be a CommError.
    return {
        r: view.get(_key(r), 0.0).decode(errors="replace") for r in ranks if view.check([_key(r)])
    }


def report_lost(store: Store, rank: int, how: str) -> None:
    """File job rank ``rank`` as dead (``how``: "killed by SIGKILL") for the ranks waiting on it."""
    base = root(store)
    base.set(_key(rank), how.encode())
    base.add(_COUNT, 1)  # after the reason: a count above zero always finds it


#: Where ranks that joined a ``plait.init`` in the launcher's store are said (:func:`joined`).
_JOINED = "plait/joined"


def mark_joined(store: Store, rank: int) -> None:
    """Say that job rank ``rank`` has claimed its rank in a ``plait.init`` that met in
    ``store`` (a :class:`JobRanks` view of the launcher's store: Note [ranks that never
    joined])."""
    root(store).set(f"{_JOINED}/{rank}", b"1")


def joined(store: Store, rank: int) -> bool:
    """Whether job rank ``rank`` has claimed its rank in a ``plait.init`` that met in
    ``store``, the launcher's own (Note [ranks that never joined]); one round trip."""
    return root(store).check([f"{_JOINED}/{rank}"])


def lost_count(store: Store) -> int:
    """How many ranks launchers have filed lost in ``store`` (0 before the first)."""
    base = root(store)
    return base.add(_COUNT, 0) if base.check([_COUNT]) else 0


def reports(store: Store, ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` a launcher filed as dead (:func:`report_lost`), and how they ended."""
    return _gave_up(root(store), ranks)


def filed(store: Store, ranks: Sequence[int]) -> dict[int, str]:
    """Which of ``ranks`` a launcher filed as dead, and how they ended.

    One round trip when none was; always empty for a store that is not a view of
    a :class:`JobRanks` namespace.
    """
    watched = _watched(store)
    if watched is not None:
        out = watched.dead(ranks)
        return {**_gave_up(watched, [r for r in ranks if r not in out]), **out}
    view = _job_view(store)
    if view is None:
        return {}
    out = _gave_up(root(view), ranks)  # what the launcher saw, first
    return {**_gave_up(view, [r for r in ranks if r not in out]), **out}


def lost_error(
    me: str, lost: dict[int, str], what: str, store: Store | None = None
) -> PeerLostError | RendezvousError:
    """The error of a start-up wait that rank(s) ``lost`` will never end: they died, or
    gave up their set-up (Note [ranks that gave up]): PeerLostError for the first,
    RendezvousError where every one of them gave up.

    ``me`` starts the message ("rank 2"); ``what`` is what the dead ranks did not
    do ("announce their segment"); ``store``: the store of the wait (a
    :class:`Watched` one names what the wait was part of).
    """
    watched = None if store is None else _watched(store)
    during = watched.during if watched is not None else "plait.init"
    gave = sorted(r for r, how in lost.items() if how.startswith(GAVE_UP))
    died = sorted(r for r in lost if r not in gave)
    if not died:
        reasons = {r: lost[r][len(GAVE_UP) :] for r in gave}
        why = "; ".join(
            t if t.startswith(f"rank {r}: ") else f"rank {r}: {t}" for r, t in reasons.items()
        )
        before = [watched.members[r] for r in gave] if watched and watched.members else gave
        was = f" (rank(s) {before} before the {during})" if before != gave else ""
        return RendezvousError(
            f"{me}: rank(s) {gave}{was} gave up {during} before they could {what} ({why})"
        )
    how = "; ".join(f"rank {r} {lost[r]}" for r in died)
    # A rank that exited by itself did not die (Note [ranks that never joined]).
    ended = "exited" if all(lost[r].startswith("exited ") for r in died) else "died"
    if watched is not None:
        text = f"{ended} before they could {what} in {during} ({how})"
    else:
        text = f"{ended} before they could {what} in plait.init ({how}, as plait run saw)"
    err = PeerLostError(f"{me}: rank(s) {died} {text}: see their output")
    err.lost_rank = died[0]
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
        RendezvousError: such a rank filed that it gave up (Note [ranks that gave up]).
        StoreTimeout: some keys were still missing after ``timeout``.
    """
    seconds = store.timeout if timeout is None else timeout
    watched = _watched(store)
    job = _job_view(store) if watched is None else None
    if job is None and watched is None:
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
        if job is not None and not (root(job).check([_COUNT]) or job.check([_COUNT])):
            continue  # nobody filed: two round trips
        key_of = dict(zip(ranks, keys, strict=True))
        missing = [r for r in ranks if not store.check([key_of[r]])]
        lost = filed(store, missing)
        # A rank may have set its key, then died, between the two looks: it did what was
        # awaited, and a wait that saw its key would return (Note [a key set before a death]).
        lost = {r: how for r, how in lost.items() if not store.check([key_of[r]])}
        if lost:
            raise lost_error(me, lost, what, store)
