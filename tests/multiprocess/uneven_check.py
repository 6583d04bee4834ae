"""Run inside every rank by ``plait run``: each uneven and object collective once.

Every rank regenerates all ranks' inputs from their seeds and checks its own
results exactly against :func:`plait.testing.reference` (uneven) or plain
Python (objects); exits non-zero, naming the call, on the first wrong result.
"""

from __future__ import annotations

import operator
import pickle
import sys
import threading

import numpy as np

import plait
from plait.testing import reference


def _rows(seed: int, rank: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed * 100 + rank).integers(-9, 9, (n, 3)).astype(np.float64)


def _check(name: str, got: object, want: np.ndarray | None) -> None:
    if want is None:
        ok = got is None
    else:
        ok = isinstance(got, np.ndarray) and got.tobytes() == want.tobytes()
        ok = ok and got.shape == want.shape
    if not ok:
        raise SystemExit(f"{name}: got {got!r}, want {want!r}")


def _ref(c: str, xs: list[np.ndarray], counts: list[int], **kw: object) -> list[np.ndarray | None]:
    flat = [x.reshape(-1) for x in xs]
    out = reference(c, flat, counts=[k * 3 for k in counts], **kw)  # type: ignore[arg-type]
    return [o.reshape(-1, 3) if o is not None else None for o in out]


def _objects_from_threads(comm: plait.Communicator, threads: int = 3, each: int = 40) -> None:
    """Rank 0's threads send objects to rank 1 on one tag at once, and rank 1's receive
    them at once: every object arrives whole (each is several messages, a large array
    apart from the rest in some)."""
    got: list[dict[str, object]] = []

    def send(t: int) -> None:
        for i in range(each):
            n = 1 + (t * 37 + i * 11) % 3000  # 8 B to 24 KiB
            comm.send_object({"t": t, "i": i, "a": np.full(n, t)}, 1, tag=9)

    def recv() -> None:
        got.extend(comm.recv_object(0, tag=9) for _ in range(each))

    errors: list[BaseException] = []

    def run(fn: object, *args: int) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except BaseException as exc:
            errors.append(exc)

    work = [(send, t) for t in range(threads)] if comm.rank == 0 else [(recv,)] * threads
    ts = [threading.Thread(target=run, args=w) for w in work]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    if errors:
        raise errors[0]
    if comm.rank == 1:
        assert sorted((o["t"], o["i"]) for o in got) == [
            (t, i) for t in range(threads) for i in range(each)
        ], "objects lost or repeated"
        assert all((o["a"] == o["t"]).all() for o in got), "an object's array is another's"


def main() -> int:
    with plait.init(timeout=60) as comm:
        r, p = comm.rank, comm.size
        rng = np.random.default_rng(7)
        counts = [int(k) for k in rng.integers(0, 4, p)]
        counts[0] = 0
        xs = [_rows(1, q, counts[q]) for q in range(p)]
        _check("allgatherv", comm.allgatherv(xs[r], counts), _ref("allgatherv", xs, counts)[r])
        root = p - 1
        want = _ref("gatherv", xs, counts, root=root)[r]
        _check("gatherv", comm.gatherv(xs[r], root=root), want)
        whole = _rows(2, root, sum(counts))
        want = _ref("scatterv", [whole] * p, counts, root=root)[r]
        mine = whole if r == root else np.empty((0, 3))
        _check("scatterv", comm.scatterv(mine, counts, root), want)
        sums = [_rows(3, q, sum(counts)) for q in range(p)]
        want = _ref("reduce_scatterv", sums, counts, op=plait.SUM)[r]
        _check("reduce_scatter(counts=)", comm.reduce_scatter(sums[r], counts=counts), want)
        m = np.random.default_rng(8).integers(0, 3, (p, p))
        sends = [_rows(4, q, int(m[q].sum())) for q in range(p)]
        want = _ref("alltoallv", sends, [int(k) for k in m.reshape(-1)])[r]
        _check("alltoallv", comm.alltoallv(sends[r], m[r], m[:, r]), want)

        obj = {"rank": r, "a": np.full((500, 2), r), "s": "x" * r}
        got = comm.bcast_object(obj if r == root else None, root)
        assert got["rank"] == root, got
        assert (got["a"] == root).all(), got
        assert [o["rank"] for o in comm.allgather_object(obj)] == list(range(p))
        g = comm.gather_object(obj, 0)
        assert (g is None) == (r != 0)
        assert comm.scatter_object(list(range(10, 10 + p)) if r == 0 else None) == 10 + r
        assert comm.alltoall_object([(r, j) for j in range(p)]) == [(q, r) for q in range(p)]
        assert comm.allreduce_object(str(r), operator.add) == "".join(map(str, range(p)))
        try:
            comm.allgather_object(threading.Lock() if r == 1 % p else r)
        except pickle.PicklingError:
            pass
        else:
            raise SystemExit("allgather_object: an unpicklable object did not raise")
        if p > 1:
            if r == 0:
                comm.send_object({"w": np.arange(1 << 18)}, 1, tag=5)
            elif r == 1:
                assert comm.recv_object(0, tag=5)["w"].sum() == np.arange(1 << 18).sum()
        if p > 1 and r < 2:
            _objects_from_threads(comm)
        comm.barrier()
        if r == 0:
            kind = type(comm._transport).__name__
            print(f"uneven and object collectives ok on {p} ranks over {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
