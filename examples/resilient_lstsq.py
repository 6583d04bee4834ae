"""Least squares that survives a lost rank: one rank is killed, the others shrink and finish.

Run it with ``plait run -n 4 --enable-recovery examples/resilient_lstsq.py`` (``--victim 2
--kill-at 20``): with ``--enable-recovery`` the launcher lets the others go on when a rank is
killed. ``python examples/resilient_lstsq.py --ranks 4`` does the same through
:func:`plait.launch.launch`.

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
import signal
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
    """Start the ranks as ``plait run -n RANKS --enable-recovery`` does; the job's exit code.

    0 when the survivors finish with the right answer (the victim's SIGKILL is reported and
    tolerated), else the first survivor's failure.
    """
    from plait.launch import Job
    from plait.launch import launch as run_job

    job = Job([sys.executable, __file__, *sys.argv[1:]], nproc=args.ranks, enable_recovery=True)
    return run_job(job)


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
