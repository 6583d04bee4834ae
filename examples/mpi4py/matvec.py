"""A distributed matrix-vector product, y = A x, with A split by rows across the ranks, then
power iteration for A's largest eigenvalue.

Each rank holds ``n / size`` rows of A and the same rows of x; the whole of x is assembled
with Allgather before each product, and norms come from Allreduce.

    plait run -n 4 --mpi4py examples/mpi4py/matvec.py
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

n = 8 * size
rows = n // size
first = rank * rows
# A symmetric matrix, each rank building only its own rows: A[i, j] = 1 / (1 + |i - j|).
i = np.arange(first, first + rows)[:, None]
j = np.arange(n)[None, :]
a_local = 1.0 / (1.0 + np.abs(i - j))


def matvec(x_local):
    x = np.empty(n)
    comm.Allgather([x_local, MPI.DOUBLE], [x, MPI.DOUBLE])
    return a_local @ x


def norm(v_local):
    return np.sqrt(comm.allreduce(float(v_local @ v_local), op=MPI.SUM))


x_local = np.ones(rows)
for _ in range(50):
    y_local = matvec(x_local)
    x_local = y_local / norm(y_local)
eigenvalue = comm.allreduce(float(x_local @ matvec(x_local)), op=MPI.SUM)

y = np.empty(n) if rank == 0 else None
comm.Gather(matvec(np.arange(rows, dtype=np.float64) + first), y, root=0)
if rank == 0:
    full = 1.0 / (1.0 + np.abs(np.arange(n)[:, None] - np.arange(n)[None, :]))
    assert np.allclose(y, full @ np.arange(n)), "the distributed product is wrong"
    assert np.isclose(eigenvalue, np.linalg.eigvalsh(full)[-1])
    print(f"A x matches the serial product; largest eigenvalue {eigenvalue:.10f}")
