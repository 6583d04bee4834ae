"""One agreement of a communicator on one rank (Note [agree] in :mod:`plait._recovery`): who
has yet to take part, the result this rank would give it, and the claim through the store
that makes exactly one rank's result the agreement's (Note [one result])."""

from __future__ import annotations

import contextlib
import time

from plait._liveness import STALE_SECONDS, Liveness
from plait.errors import CommTimeout
from plait.rendezvous.store import Store, StoreTimeout

__all__ = ["SETTLE_SECONDS", "SLICE", "VOID", "Ballot"]

#: Longest single wait of agree in the store, between two looks at who failed.
SLICE = 0.25
#: The result of an agreement given up at a rank's timeout (Note [agree]).
VOID = "void"
#: Seconds a rank that lost the claim waits, at most, for the winner to write its result:
#: long enough for a winner stopped in between to be found failed (Note [one result]).
SETTLE_SECONDS = STALE_SECONDS + 1.0

# Note [one result]
#     Agreement ``k`` ends with one result, which every rank that reads it returns (or
#     raises, where it is void): the late ranks too, and the coordinator, whatever its
#     timeout. A rank that decides (the coordinator once every rank took part or failed, or
#     at its deadline; any other rank at its deadline and last look, whose coordinator gave
#     no result) does not write the result but claims it:
#
#     1. it writes what it would decide to ``proposal/<rank>``;
#     2. it adds 1 to ``claims``: the store's add is atomic (it has no compare-and-set),
#        so exactly one rank reads 1;
#     3. that rank writes its proposal to ``result``; the others write ``lost/<rank>`` and
#        read ``result``.
#
#     So a rank that timed out voids the agreement even where the coordinator is the rank
#     that never came (it used to write nothing, and the coordinator, arriving later,
#     decided a result the others never saw, and a shrink connected to survivors that had
#     given up), and a coordinator whose timeout is longer than the others' decides only
#     if no rank gave up first. The winner may die between 2 and 3: a rank that waits for
#     the result then looks for the ranks that proposed and did not lose (one of them
#     won); once all of them are failed and the result is still missing, the winner was
#     one of them. Where there is one, its proposal is the result, which the rank writes
#     for the others (the winner, were it only stopped, would write the same). Two or more,
#     each failed between its proposal and its word, leave the result unknown: every rank
#     raises CommTimeout, and the next agree is the next agreement. One that neither
#     fails nor writes within SETTLE_SECONDS makes the waiting rank raise CommTimeout.


class Ballot:
    """Agreement number ``k`` of a communicator, on rank ``rank`` of ``size``, for the call
    ``what`` (agree or shrink)."""

    def __init__(
        self, store: Store, live: Liveness, rank: int, size: int, k: int, what: str
    ) -> None:
        self.store = store
        self.live = live
        self.rank = rank
        self.size = size
        self.k = k
        self.what = what  # the call, as errors name it
        self.keys = f"agree/{k}/"
        self.seen: dict[int, tuple[int, float]] = {}  # heartbeats as seen (Liveness.how)

    def take_part(self, flag: int) -> None:
        """Write this rank's flag."""
        self.store.set(f"{self.keys}flag/{self.rank}", str(flag).encode())

    def coordinator(self) -> int:
        """The lowest rank not failed (this rank, if all below it failed)."""
        for p in range(self.rank):
            if not self.live.has_failed(p, self.seen):
                return p
        return self.rank

    def result(self) -> str | None:
        """The agreement's result, if it has one yet."""
        key = f"{self.keys}result"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def wait(self, seconds: float) -> str | None:
        """The result, once written within ``seconds``; else None."""
        try:
            self.store.wait([f"{self.keys}result"], seconds)
        except StoreTimeout:
            return None
        return self.store.get(f"{self.keys}result").decode()

    def missing(self, until: float) -> list[int]:
        """The ranks that have neither written their flag nor failed, once there are none
        or at ``until`` (monotonic), whichever comes first; none once the agreement has a
        result."""
        store, keys = self.store, self.keys
        while True:
            if store.check([f"{keys}result"]):
                return []
            missing = [
                p
                for p in range(self.size)
                if p not in self.live.failed and not store.check([f"{keys}flag/{p}"])
            ]
            missing = [p for p in missing if not self.live.has_failed(p, self.seen)]
            left = until - time.monotonic()
            if not missing or left <= 0:
                return missing
            with contextlib.suppress(StoreTimeout):
                store.wait([f"{keys}flag/{missing[0]}"], min(SLICE, left))

    def decide(self, until: float) -> str | None:
        """Wait until every rank wrote its flag or failed, or ``until``; claim the result
        this rank then sees (void where some rank is missing). The agreement's result, or
        None where another rank's claim won (:meth:`settle` reads what it decided)."""
        text = self.result()
        if text is not None:
            return text
        store, keys = self.store, self.keys
        missing = self.missing(until)
        text = self.result()  # a rank that gave up, or took over, decided meanwhile
        if text is not None:
            return text
        if missing:
            text = f"{VOID} {self.rank} {','.join(map(str, missing))}"
        else:
            value = -1  # all bits set: the identity of AND
            present = [p for p in range(self.size) if p not in self.live.failed]
            present = [p for p in present if store.check([f"{keys}flag/{p}"])]
            for p in present:
                value &= int(store.get(f"{keys}flag/{p}"))
            text = f"{value} {','.join(map(str, present))}"
        # Note [one result]: propose, claim, and write it only where the claim won.
        store.set(f"{keys}proposal/{self.rank}", text.encode())
        if store.add(f"{keys}claims", 1) == 1:
            store.set(f"{keys}result", text.encode())
            return text
        store.set(f"{keys}lost/{self.rank}", b"1")
        return None  # the winner writes it right after its claim: settle waits for it

    def settle(self, seconds: float) -> str:
        """The result another rank claimed: once it writes it, or, where every rank that
        may have won failed before it did, its proposal (Note [one result])."""
        store, keys = self.store, self.keys
        until = time.monotonic() + seconds
        while True:
            text = self.wait(SLICE)
            if text is not None:
                return text
            claimed = [
                p
                for p in range(self.size)
                if p != self.rank
                and store.check([f"{keys}proposal/{p}"])
                and not store.check([f"{keys}lost/{p}"])
            ]
            alive = [p for p in claimed if not self.live.has_failed(p, self.seen)]
            if not alive:
                text = self.result()  # written just before it died
                if text is not None:
                    return text
                if len(claimed) == 1:
                    text = store.get(f"{keys}proposal/{claimed[0]}").decode()
                    store.set(f"{keys}result", text.encode())
                    return text
                raise CommTimeout(
                    f"{self._me}: one of rank(s) {claimed} claimed its result and failed "
                    "before it wrote it, which leaves it unknown; the next agree of every rank "
                    "is the next agreement"
                )
            if time.monotonic() >= until:
                raise CommTimeout(
                    f"{self._me}: rank(s) {alive} claimed its result and wrote none within "
                    f"{seconds:g} s, nor were found failed"
                )

    @property
    def _me(self) -> str:
        return f"rank {self.rank}: {self.what}: agree #{self.k}"
