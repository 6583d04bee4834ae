"""Least squares that survives a lost rank: one rank is killed, the others shrink and finish.

Run it with ``python examples/resilient_lstsq.py`` (``--ranks 4 --victim 2 --kill-at 20``).
It starts its ranks itself and serves their store, as ``plait run`` would; ``plait run``
itself stops a job when a rank dies, and this job goes on without it.

Each rank holds its own rows ``(A_r, b_r)`` of an overdetermined system, and the ranks
minimise ``sum_r |A_r x - b_r|^2`` by gradient descent: every step allreduces the gradient
``sum_r A_r^T (A_r x - b_r)``. At step ``--kill-at`` rank ``--victim`` kills itself with
SIGKILL. The survivors' allreduce fails; each survivor aborts the communicator (so that no
rank stays inside a call on it), ``shrink`` agrees on who is left and connects them
afresh, and the survivors go on from their current ``x`` with their own rows only. Rank 0
of the survivors checks the result against numpy's ``lstsq`` of the survivors' rows.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys

import numpy as np

import plait

#: Unknowns, and rows each rank holds.
FEATURES = 8
ROWS = 200


def problem(rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s rows of the system (the same on every run)."""
    rng = np.random.default_rng(1000 + rank)
    a = rng.standard_normal((ROWS, FEATURES))
    b = a @ np.arange(1.0, FEATURES + 1) + rng.standard_normal(ROWS) * (1 + rank)
    return a, b


def step_size(comm: plait.Communicator, a: np.ndarray) -> float:
    """1 / L, L the largest eigenvalue of the ranks' ``sum A_r^T A_r``: a safe step."""
    return 1.0 / float(np.linalg.eigvalsh(comm.allreduce(a.T @ a))[-1])


def solve(args: argparse.Namespace) -> int:
    """One rank: gradient descent, shrinking the communicator when a rank is lost."""
    comm = plait.init(timeout=60)
    me = comm.rank  # the rank in the first communicator, which names the rows
    a, b = problem(me)
    x = np.zeros(FEATURES)
    lr = step_size(comm, a)
    step = shrinks = 0
    while step < args.steps:
        if step == args.kill_at and me == args.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            grad = comm.allreduce(a.T @ (a @ x - b))
        except plait.CommError:
            comm.abort("lost a rank")  # every survivor leaves its call on the old communicator
            comm = comm.shrink()
            shrinks += 1
            lr = step_size(comm, a)  # the survivors' rows only, from here on
            continue  # this step again, with the survivors
        x -= lr * grad
        step += 1
        if np.linalg.norm(grad) < args.tol:
            break
    survivors = [int(r) for r in comm.allgather(np.array([me])).ravel()]
    if comm.rank == 0:
        rows = [problem(r) for r in survivors]
        want = np.linalg.lstsq(
            np.vstack([r[0] for r in rows]), np.concatenate([r[1] for r in rows]), rcond=None
        )[0]
        err = float(np.linalg.norm(x - want) / np.linalg.norm(want))
        print(
            f"survivors {survivors} after {shrinks} shrink(s), {step} steps: relative error "
            f"against numpy's lstsq of their rows {err:.1e}"
            + ("; matches numpy" if err < 1e-8 else "; DOES NOT MATCH"),
            flush=True,
        )
        if err >= 1e-8:
            comm.close()
            return 1
    comm.close()
    return 0


def launch(args: argparse.Namespace) -> int:
    """Serve the store, start the ranks, and check that only the victim failed."""
    from plait.rendezvous.tcp_store import TCPStoreServer

    secret = secrets.token_hex(16)
    server = TCPStoreServer("127.0.0.1", 0, secret=secret.encode())
    try:
        procs = []
        for r in range(args.ranks):
            env = {
                **os.environ,
                "PLAIT_RANK": str(r),
                "PLAIT_SIZE": str(args.ranks),
                "PLAIT_LOCAL_RANK": str(r),
                "PLAIT_STORE": f"tcp://127.0.0.1:{server.port}",
                "PLAIT_SECRET": secret,
            }
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.close()
    others = [c for r, c in enumerate(codes) if r != args.victim]
    if codes[args.victim] != -signal.SIGKILL or any(others):
        print(f"unexpected exit codes: {codes}", file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--victim", type=int, default=2, help="the rank that is killed")
    parser.add_argument("--kill-at", type=int, default=20, help="the step it dies at")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--tol", type=float, default=1e-9)
    args = parser.parse_args()
    if not 0 <= args.victim < args.ranks or args.ranks < 2:
        parser.error("need --ranks >= 2 and 0 <= --victim < --ranks")
    return solve(args) if "PLAIT_RANK" in os.environ else launch(args)


if __name__ == "__main__":
    sys.exit(main())
