"""Distributed conjugate gradient: allreduce dot products, neighbour halo exchange.

Run it with ``plait run -n 4 examples/conjugate_gradient.py``. It solves
``A x = b`` for the 1-D Poisson matrix (2 on the diagonal, -1 beside it) plus
a small shift, with the rows split into one contiguous block per rank:

- the matrix-vector product needs one value from each neighbouring block
  (a halo exchange with ``send``/``recv``);
- every dot product is a local sum followed by ``allreduce``, so every rank
  sees the same scalars and takes the same steps.

Rank 0 then checks the gathered solution against a single-process numpy
solve of the same system and prints the iterations, residual and error.
"""

from __future__ import annotations

import argparse

import numpy as np

import plait


def matvec(comm: plait.Communicator, x: np.ndarray, shift: float) -> np.ndarray:
    """This rank's rows of ``(T + shift I) x``, T the tridiagonal Poisson matrix."""
    left = np.zeros(1)
    right = np.zeros(1)
    r, size = comm.rank, comm.size
    # Even ranks talk to the right first, odd ranks to the left first: no cycle of waits.
    for phase in (0, 1):
        if (r + phase) % 2 == 0 and r + 1 < size:
            comm.send(x[-1:].copy(), r + 1, tag=1)
            comm.recv(right, r + 1, tag=2)
        elif (r + phase) % 2 == 1 and r > 0:
            comm.recv(left, r - 1, tag=1)
            comm.send(x[:1].copy(), r - 1, tag=2)
    y = (2.0 + shift) * x
    y[1:] -= x[:-1]
    y[:-1] -= x[1:]
    y[0] -= left[0]
    y[-1] -= right[0]
    return y


def dot(comm: plait.Communicator, a: np.ndarray, b: np.ndarray) -> float:
    return float(comm.allreduce(np.array([a @ b]))[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2400, help="unknowns (a multiple of the ranks)")
    parser.add_argument("--shift", type=float, default=0.01)
    parser.add_argument("--tol", type=float, default=1e-10)
    args = parser.parse_args()
    with plait.init() as comm:
        if args.n % comm.size:
            raise SystemExit(f"--n {args.n} must be a multiple of the {comm.size} ranks")
        m = args.n // comm.size
        lo = comm.rank * m
        b = np.sin(np.arange(lo, lo + m) * 0.01) + 1.0  # this rank's rows of b
        x = np.zeros(m)
        r = b - matvec(comm, x, args.shift)
        p = r.copy()
        rr = dot(comm, r, r)
        b_norm = np.sqrt(dot(comm, b, b))
        iterations = 0
        while np.sqrt(rr) > args.tol * b_norm and iterations < 10 * args.n:
            ap = matvec(comm, p, args.shift)
            alpha = rr / dot(comm, p, ap)
            x += alpha * p
            r -= alpha * ap
            rr_new = dot(comm, r, r)
            p = r + (rr_new / rr) * p
            rr = rr_new
            iterations += 1
        full = comm.allgather(x).reshape(-1)
        if comm.rank == 0:
            n = args.n
            a = np.diag(np.full(n, 2.0 + args.shift))
            a -= np.diag(np.ones(n - 1), 1) + np.diag(np.ones(n - 1), -1)
            b_full = np.sin(np.arange(n) * 0.01) + 1.0
            want = np.linalg.solve(a, b_full)
            err = np.linalg.norm(full - want) / np.linalg.norm(want)
            res = np.linalg.norm(a @ full - b_full) / np.linalg.norm(b_full)
            print(
                f"{comm.size} ranks, {n} unknowns: converged in {iterations} iterations; "
                f"relative residual {res:.2e}, relative error against numpy's solve {err:.2e}"
            )
            if err > 1e-6:
                raise SystemExit("the distributed solution differs from numpy's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
