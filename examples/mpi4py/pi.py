"""Parallel pi: integrate 4 / (1 + x^2) over [0, 1] with the midpoint rule, the work split
across the ranks; the classic MPI program (the number of intervals is broadcast, the partial
sums reduced).

    plait run -n 4 --mpi4py examples/mpi4py/pi.py 100000
"""

import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

n = np.array(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000, dtype="i")
comm.Bcast([n, MPI.INT], root=0)
h = 1.0 / n
x = h * (np.arange(rank, int(n), size) + 0.5)
mine = np.array(h * np.sum(4.0 / (1.0 + x * x)))
pi = np.array(0.0)
comm.Reduce([mine, MPI.DOUBLE], [pi, MPI.DOUBLE], op=MPI.SUM, root=0)
if rank == 0:
    print(f"pi is approximately {pi:.12f}, error {abs(pi - np.pi):.2e}")
# The same sum with the lowercase API, as every rank's Python float.
same = comm.allreduce(float(mine), op=MPI.SUM)
assert abs(same - float(pi if rank == 0 else same)) < 1e-12
