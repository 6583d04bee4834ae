"""How the members of a Ray collective group find each other, with nothing stale.

Note [one incarnation of a Ray group]
    Ray names groups, and a name is reused: a group is destroyed (after a
    member died, say) and created again under the same name, maybe with
    fresh actors. Whatever the first incarnation left in the key-value store
    (addresses of dead processes, counters) must never reach the second. So
    each incarnation meets under a fresh random token, and only rank 0 makes
    it; the other ranks learn it from rank 0 in a way that cannot be stale:

    1. Rank r > 0 draws a fresh nonce, writes ``arrive/<nonce>`` (its rank
       and world size) and waits for ``ack/<nonce>/<token>``, which names the
       token; once it has read it, it deletes both.
    2. Rank 0 draws the token, writes an arrival of its own (for Note
       [members that disagree]) and, until every rank has joined it (while
       ``plait.init`` waits for them), answers every other ``arrive/<nonce>``
       it finds with ``ack/<nonce>/<token>``.
    3. Every rank says its rank and world size under the token
       (``run/<token>/ray/member/<rank>/<size>/<nonce>``; rank 0 before it
       answers anyone) and runs ``plait.init`` on a store whose keys all start
       with ``run/<token>/``.

    A nonce is new, so its answer comes from a rank 0 that is creating the
    group now; a token is new, so nothing under it predates the incarnation.
    All of this lives in the namespace ``plait/<job id>/<group name>`` of
    Ray's internal key-value store. Note [the keys of a finished incarnation]
    says when the keys go.

Note [members that disagree]
    Two actors given one rank, or members given different world sizes,
    would each wait until the timeout for a rank that never comes. So each
    member looks, as it joins and then at every poll while ``plait.init``
    waits (the store's ``on_poll``), at what is fresh and can only come from
    members creating the group now, never at an arrival (one may be left by
    a process that died waiting, maybe of an incarnation of another size):

    - the members' keys under the token: a world size not its own, or two
      nonces of one rank, and it marks the incarnation failed
      (``run/<token>/ray/failed``, put-if-absent, the reason as the value)
      and raises. Rank 0's key is there before anyone knows the token, so a
      member told another world size than rank 0 fails as it joins.
    - ``run/<token>/ray/failed``: another member found a disagreement; it
      raises with that member's reason.
    - the answers to its own fresh nonce: two answers (a rank r > 0), or one
      with another token (rank 0, whose arrival only another rank 0
      answers), mean two rank 0s creating the group now. It marks both
      tokens failed and raises.

    Every member that can tell fails within a poll (50 ms at most) and the
    others at their next; a rank 0 that fails so keeps its answers to
    arrivals still waiting, so that they join, read the mark and fail too.
    A member that fails deletes its own member key, so it may try again.

    A member that arrives after rank 0 failed so is answered by nobody. So
    rank 0, before it stops answering, leaves the reason as the group's
    verdict (key ``verdict``, beside the arrivals). A member whose arrival
    is unanswered and that finds a verdict gives a new rank 0 VERDICT_GRACE
    (1 s) to answer it, then raises the verdict's RendezvousError. The
    grace is for a group created again after a failure: its other members
    may arrive before its rank 0, which deletes the verdict as it begins
    (and again once the group is created) and answers them. A member of it
    that arrives more than the grace before its rank 0 takes the old verdict
    for its own; only a failure with no rank 0 for a second after it can
    tell the two apart, and such a member would otherwise wait out its
    timeout too. A member that comes after the group was created with all
    of its members (a second rank 0 or a second rank 1 that started late)
    still waits out its timeout: nobody answers it any more, and nothing
    fresh says why.

Note [the keys of a finished incarnation]
    ``plait.init`` needs the store until every rank has connected, and a rank
    whose ``init`` has returned does not know that the others' have: one may
    still read a peer's address. So creating the group ends with a barrier on
    the new communicator. Once it has passed, no member of the incarnation
    reads the store again (the communicator is given the store as an object,
    so no recovery thread watches it), and rank 0 deletes everything under
    ``run/<token>/``, the arrivals it answered (and their answers: arrivals
    left by processes that died waiting are among them) and the keys of the
    incarnations it found under ``run/`` when it began. Those are finished:
    created, so their members no longer read them, or failed, so they never
    will be: one name is one group at a time, and an incarnation still being
    created when this one began would have had a second rank 0 creating the
    group beside this one's. An incarnation begun after this one is not among
    them.

    A rank 0 that dies between the barrier and its deletions leaves the keys;
    so each member deletes ``run/<token>/`` again when it destroys the group
    (after the barrier, so no member needs them; deleting twice is
    harmless). Nothing depends on rank 0 living until the group is destroyed.

    A creation that fails leaves ``run/<token>/`` as it is: the other members
    are still waiting there, and what a failing rank filed for them
    (Note [ranks that gave up] in :mod:`plait.rendezvous.lost`) must reach
    them. The next incarnation's rank 0 deletes it (above). A rank 0 that
    fails stops answering and deletes its arrival and the arrivals it
    answered, but for those still waiting where the incarnation is marked
    failed; there it leaves the verdict, which the next rank 0 deletes as
    it begins (Note [members that disagree]).

Note [one deadline for creating a group]
    PLAIT_TIMEOUT bounds the whole creation of a group on a member: the
    wait for rank 0's answer, ``plait.init`` and the closing barrier each
    get what is left of one deadline (``plait.init`` in tenths of a second,
    which its errors then say), so a member that waited long for rank 0 and
    then for a missing rank gives up at its timeout, not a timeout later. A
    timeout carries a note of the time it took in all. The communicator's
    calls still default to the whole timeout.

Note [groups are created in one order]
    Creating a group is a collective call: it returns once every member has
    made it, and a process creates one group at a time (the actor's call
    blocks, and Ray holds its lock of the process's groups meanwhile). An
    actor that creates A then B beside one that creates B then A waits in A
    for the other, which waits in B for it, until the timeout (Ray's gloo
    groups do the same). Every member must create its groups in the same
    order. Nothing can tell this from a member that is only late: the member
    missing from A has written nothing of A yet, and nothing of B says that
    it will join A. So the timeout says it, as one of the causes (a note on
    the StoreTimeout). Destroying a group is local: groups are destroyed in
    any order.

Note [the job's secret]
    plait authenticates its TCP connections with PLAIT_SECRET
    (:mod:`plait._auth`). Where a process has none, the first member of any
    plait group of the Ray job draws one and keeps it in Ray's key-value
    store (namespace ``plait/<job id>``, key ``secret``, put-if-absent, so
    every process reads the same), and each process sets PLAIT_SECRET to it.
    A process given PLAIT_SECRET (``runtime_env={"env_vars": ...}``) keeps
    its own: give every member the same one. Whoever can reach the GCS can
    read the secret, but can also run code in the cluster.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import time
from collections.abc import Callable, Iterable, MutableMapping
from typing import NoReturn

import plait
from plait.errors import CommTimeout, RendezvousError
from plait.ray._store import KeyValue, RayKVStore, poll_until
from plait.rendezvous.store import StoreTimeout

__all__ = [
    "VERDICT",
    "VERDICT_GRACE",
    "Meeting",
    "adopt_secret",
    "create",
    "group_namespace",
    "job_namespace",
    "meet",
]

#: Where rank 0 leaves the verdict of a creation that failed (Note [members that disagree]).
VERDICT = "verdict"
#: Seconds a member that finds a verdict and no answer gives a new rank 0 to answer it.
VERDICT_GRACE = 1.0

#: Said with every timeout of a group's creation (Note [groups are created in one order]).
_CROSSED = (
    "Ray group {name!r}: if a member is creating another group first, it waits there for "
    "this group's members as they wait here for it (a process creates one group at a time): "
    "create the groups in the same order on every member"
)


def job_namespace(job_id: str) -> str:
    """The key-value namespace of plait's job-wide keys (the secret)."""
    return f"plait/{job_id}"


def group_namespace(job_id: str, group_name: str) -> str:
    """The key-value namespace of one Ray group (Note [one incarnation of a Ray group])."""
    return f"plait/{job_id}/{group_name}"


def adopt_secret(kv: KeyValue, environ: MutableMapping[str, str] | None = None) -> str:
    """Make sure this process has the job's PLAIT_SECRET; returns it (Note [the job's secret])."""
    env: MutableMapping[str, str] = os.environ if environ is None else environ
    own = env.get("PLAIT_SECRET", "")
    if own:
        return own
    kv.put("secret", secrets.token_hex(32).encode(), False)
    stored = kv.get("secret")
    if not stored:
        raise RendezvousError("Ray's key-value store lost plait's job secret just after it was set")
    env["PLAIT_SECRET"] = stored.decode()
    return env["PLAIT_SECRET"]


class Meeting:
    """One rank's part in creating one incarnation of a group.

    Attributes:
        store: the store ``plait.init`` meets through (prefix ``run/<token>/``).
        token: the incarnation's token.
        nonce: this rank's arrival.
    """

    def __init__(
        self,
        kv: KeyValue,
        store: RayKVStore,
        token: str,
        rank: int,
        size: int,
        group_name: str,
        nonce: str,
        older: Iterable[str] = (),
    ) -> None:
        self.kv = kv
        self.store = store
        self.token = token
        self.rank = rank
        self.size = size
        self.group_name = group_name
        self.nonce = nonce
        self._answered: set[str] = set()
        self._older = set(older) - {token}  # rank 0: incarnations found when it began
        self._doomed = False  # the incarnation is marked failed (Note [members that disagree])
        self._verdict = ""  # and why
        self._space = f"run/{token}/ray/"  # the members' own keys (plait.init's are beside)
        self._member = f"{self._space}member/{rank}/{size}/{nonce}"

    def enter(self) -> None:
        """Say this member's rank and world size under the token, then begin to check."""
        self.kv.put(self._member, b"", True)
        self.store.on_poll = self.check

    def check(self) -> None:
        """Rank 0: answer new arrivals; every rank: raise if the members disagree.

        Runs while this rank waits in ``plait.init`` (Note [members that disagree]).

        Raises:
            RendezvousError: two actors were given one rank, the members different
                world sizes, or another member found either.
        """
        if self.rank == 0:
            for key in self.kv.keys("arrive/"):
                nonce = key.removeprefix("arrive/")
                if nonce not in self._answered and nonce != self.nonce:
                    self.kv.put(f"ack/{nonce}/{self.token}", self.token.encode(), True)
                    self._answered.add(nonce)
            others = {k.rpartition("/")[2] for k in self.kv.keys(f"ack/{self.nonce}/")}
            others.discard(self.token)
            if others:
                self._fail(_rank_twice(self.group_name, 0), others)
        keys = self.kv.keys(self._space)
        if f"{self._space}failed" in keys:
            self._doomed = True
            told = self.kv.get(f"{self._space}failed")
            self._verdict = (
                told.decode() if told else f"Ray group {self.group_name!r}: a member gave up"
            )
            raise RendezvousError(self._verdict)
        members: dict[int, set[str]] = {}
        sizes: dict[int, str] = {}
        for key in keys:
            kind, _, rest = key.removeprefix(self._space).partition("/")
            parts = rest.split("/")
            if kind != "member" or len(parts) != 3 or not parts[0].isdigit():
                continue
            members.setdefault(int(parts[0]), set()).add(parts[2])
            sizes[int(parts[0])] = parts[1]
        if set(sizes.values()) - {str(self.size)}:
            sizes[self.rank] = str(self.size)
            said = ", ".join(f"rank {r}: {n}" for r, n in sorted(sizes.items()))
            self._fail(
                f"Ray group {self.group_name!r}: its members were given different world "
                f"sizes ({said}): every member must pass the same world_size"
            )
        for rank, nonces in sorted(members.items()):
            if len(nonces) > 1:
                self._fail(_rank_twice(self.group_name, rank))

    def joined(self) -> None:
        """Every member has joined (the creation's barrier passed): rank 0 deletes the keys.

        Note [the keys of a finished incarnation]: the incarnation's, the answered
        arrivals, and the keys of the incarnations found when this one began.
        """
        self.store.on_poll = None
        if self.rank == 0:
            with contextlib.suppress(Exception):
                self.kv.delete(VERDICT)
            for nonce in self._answered | {self.nonce}:
                with contextlib.suppress(Exception):
                    self.kv.delete(f"arrive/{nonce}")
                    self.kv.delete(f"ack/{nonce}/", by_prefix=True)
            with contextlib.suppress(Exception):
                self.store.clear()
            for token in self._older:
                with contextlib.suppress(Exception):
                    self.kv.delete(f"run/{token}/", by_prefix=True)
        self._answered.clear()

    def failed(self) -> None:
        """Creating the group failed here: stop answering; the incarnation's keys stay.

        Others may still wait there and read what this rank filed for them
        (Note [the keys of a finished incarnation]). This rank's claim goes, so
        that it may try again; where the members disagree, rank 0 keeps its answers
        to arrivals still waiting, so that they learn why, and leaves the verdict
        for members that arrive later (Note [members that disagree]).
        """
        self.store.on_poll = None
        with contextlib.suppress(Exception):
            self.kv.delete(self._member)
        if self.rank != 0:
            return
        if self._doomed:  # before it stops answering: a later arrival finds one or the other
            with contextlib.suppress(Exception):
                self.kv.put(VERDICT, self._verdict.encode(), True)
        for nonce in self._answered | {self.nonce}:
            with contextlib.suppress(Exception):
                if nonce != self.nonce and self._doomed and self.kv.exists(f"arrive/{nonce}"):
                    continue
                self.kv.delete(f"arrive/{nonce}")
                self.kv.delete(f"ack/{nonce}/{self.token}")
                if nonce == self.nonce:
                    self.kv.delete(f"ack/{nonce}/", by_prefix=True)
        self._answered.clear()

    def forget(self) -> None:
        """The group is destroyed: delete the incarnation's keys, if any are left.

        Any member may: the creation's barrier passed, so no member reads them
        (Note [the keys of a finished incarnation]).
        """
        with contextlib.suppress(Exception):
            self.store.clear()

    def _fail(self, message: str, tokens: Iterable[str] = ()) -> NoReturn:
        """Mark this incarnation (and ``tokens``') failed with ``message``, and raise it."""
        self._doomed = True
        self._verdict = message
        for token in {self.token, *tokens}:
            with contextlib.suppress(Exception):
                self.kv.put(f"run/{token}/ray/failed", message.encode(), False)
        raise RendezvousError(message)


def _rank_twice(group_name: str, rank: int) -> str:
    """The error of a rank given to two actors."""
    return (
        f"Ray group {group_name!r}: rank {rank} was given to two actors: every member needs a "
        "rank of its own (init_collective_group's rank, create_collective_group's ranks)"
    )


def meet(
    kv: KeyValue,
    rank: int,
    size: int,
    group_name: str,
    timeout: float,
    *,
    host: str | None = None,
    token: Callable[[], str] = lambda: secrets.token_hex(16),
) -> Meeting:
    """Find this incarnation's token (Note [one incarnation of a Ray group]).

    Rank 0 returns at once (it answers the others while ``plait.init`` waits);
    another rank returns once rank 0 has answered its arrival. Either has said
    its rank and world size under the token (:meth:`Meeting.enter`).

    Raises:
        StoreTimeout: rank 0 did not answer within ``timeout`` seconds.
        RendezvousError: two rank 0s answered, or a creation of the group failed
            before this rank arrived and no rank 0 answered it since (Note [members
            that disagree]).
    """
    nonce = token()
    arrival = f"{rank} {size}".encode()
    if rank == 0:
        kv.delete(VERDICT)  # a failed creation's: this rank 0 answers who comes now
        older = {key.split("/")[1] for key in kv.keys("run/")}
        run = token()
        store = RayKVStore(kv, f"run/{run}/", timeout=timeout, host=host)
        meeting = Meeting(kv, store, run, rank, size, group_name, nonce, older)
        meeting.enter()  # before any member can know the token
        kv.put(f"arrive/{nonce}", arrival, True)  # another rank 0 would answer it
        return meeting
    kv.put(f"arrive/{nonce}", arrival, True)
    found: set[str] = set()
    verdict: list[bytes] = []  # the verdict found, while it stands
    seen: list[float] = []  # when it was first found

    def answered() -> bool:
        found.update(k.rpartition("/")[2] for k in kv.keys(f"ack/{nonce}/"))
        if found:
            return True
        told = kv.get(VERDICT)
        verdict[:] = [] if told is None else [told]
        if told is None:
            seen.clear()
        elif not seen:
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] >= VERDICT_GRACE

    try:
        if not poll_until(answered, time.monotonic() + timeout) and not verdict:
            raise StoreTimeout(
                f"Ray group {group_name!r}: rank {rank} of {size}: rank 0 did not create the "
                f"group within {timeout:g} s (not started, failed, or given another group name)"
            )
    finally:
        with contextlib.suppress(Exception):
            kv.delete(f"arrive/{nonce}")
            kv.delete(f"ack/{nonce}/", by_prefix=True)
    if not found:
        failed = RendezvousError(verdict[0].decode())
        failed.add_note(
            f"Ray group {group_name!r}: rank {rank} of {size} arrived after the other members "
            f"had failed to create the group so, and no rank 0 answered it within "
            f"{VERDICT_GRACE:g} s"
        )
        raise failed
    run = min(found)
    store = RayKVStore(kv, f"run/{run}/", timeout=timeout, host=host)
    meeting = Meeting(kv, store, run, rank, size, group_name, nonce)
    if len(found) > 1:  # answers to a fresh nonce: two rank 0s create the group now
        meeting._fail(_rank_twice(group_name, 0), found)
    meeting.enter()
    return meeting


def create(
    kv: KeyValue,
    rank: int,
    size: int,
    group_name: str,
    timeout: float,
    *,
    host: str | None = None,
    token: Callable[[], str] = lambda: secrets.token_hex(16),
) -> tuple[Meeting, plait.Communicator]:
    """Create one incarnation of a group on this rank: meet, connect, and leave no keys.

    ``timeout`` bounds the whole creation: meeting rank 0, ``plait.init`` and the
    barrier each get what is left of it (Note [one deadline for creating a group]).
    It is also the communicator's default timeout per call. The barrier at the end
    makes sure no member still reads the store before any deletes it (Note [the keys
    of a finished incarnation]).

    Raises:
        StoreTimeout: rank 0 did not answer, or some ranks did not arrive, in time.
        CommError: ``plait.init`` or the barrier failed.
    """
    start = time.monotonic()
    deadline = start + timeout

    def left() -> float:
        """What is left of the creation's time; in tenths, which the errors then say."""
        seconds = max(deadline - time.monotonic(), 0.001)
        return seconds if seconds < 0.1 or math.isinf(seconds) else math.floor(seconds * 10) / 10

    try:
        meeting = meet(kv, rank, size, group_name, timeout, host=host, token=token)
        try:
            meeting.check()  # a member told another world size than rank 0 fails here
            comm = plait.init(rank=rank, size=size, store=meeting.store, timeout=left())
            try:
                comm.barrier(timeout=left())
            except BaseException:
                comm.close()
                raise
        except BaseException:
            meeting.failed()
            raise
    except StoreTimeout as exc:
        exc.add_note(
            f"Ray group {group_name!r}: rank {rank} of {size} gave up creating the group after "
            f"{time.monotonic() - start:.1f} s of its {timeout:g} s (PLAIT_TIMEOUT bounds "
            "the whole creation: meeting rank 0, plait.init and the closing barrier)"
        )
        exc.add_note(_CROSSED.format(name=group_name))
        raise
    except CommTimeout as exc:
        exc.add_note(
            f"Ray group {group_name!r}: rank {rank} of {size} gave up creating the group after "
            f"{time.monotonic() - start:.1f} s of its {timeout:g} s"
        )
        raise
    # plait.init was given what was left of the creation's time, which its calls would
    # take as their default: they get the group's timeout instead.
    comm._runner.timeout = timeout
    meeting.joined()
    return meeting, comm
