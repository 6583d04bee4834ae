"""mpi4py's tutorial on buffers (numpy arrays): explicit and automatic datatypes, every
collective, ``IN_PLACE``, the ``v`` variants, and MAXLOC with (value, index) pairs.

Run with 2 or more ranks: ``plait run -n 4 --mpi4py examples/mpi4py/buffers.py``.
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

# Passing buffers with explicit MPI datatypes, and with automatic ones.
if rank == 0:
    data = np.arange(1000, dtype="i")
    comm.Send([data, MPI.INT], dest=1, tag=77)
    comm.Send(np.arange(100, dtype=np.float64), dest=1, tag=13)
elif rank == 1:
    data = np.empty(1000, dtype="i")
    comm.Recv([data, MPI.INT], source=0, tag=77)
    floats = np.empty(100, dtype=np.float64)
    comm.Recv(floats, source=0, tag=13)
    print("Recv", data.sum(), floats.sum())

# A receive buffer larger than the message; the status counts what came.
if rank == 0:
    comm.Send(np.arange(5, dtype=np.float64), dest=1, tag=3)
elif rank == 1:
    status = MPI.Status()
    big = np.zeros(10)
    comm.Recv(big, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
    print("partial", status.Get_source(), status.Get_tag(), status.Get_count(MPI.DOUBLE), big)

# Non-blocking, around a ring.
right, left = (rank + 1) % size, (rank - 1) % size
out = np.full(4, rank, dtype=np.int64)
into = np.empty(4, dtype=np.int64)
reqs = [comm.Irecv([into, MPI.INT64_T], source=left, tag=5), comm.Isend(out, dest=right, tag=5)]
MPI.Request.Waitall(reqs)
print("ring", into)
got = np.empty(2)
comm.Sendrecv(np.array([rank, rank * 0.5]), dest=right, recvbuf=got, source=left)
print("Sendrecv", got)

# Broadcasting a numpy array.
data = np.arange(100, dtype="i") if rank == 0 else np.empty(100, dtype="i")
comm.Bcast(data, root=0)
assert np.array_equal(data, np.arange(100, dtype="i"))

# Scattering and gathering numpy arrays.
sendbuf = np.empty([size, 100], dtype="i") if rank == 0 else None
if rank == 0:
    sendbuf.T[:, :] = range(size)
recvbuf = np.empty(100, dtype="i")
comm.Scatter(sendbuf, recvbuf, root=0)
assert np.allclose(recvbuf, rank)
gathered = np.empty([size, 100], dtype="i") if rank == 0 else None
comm.Gather(recvbuf, gathered, root=0)
if rank == 0:
    assert all(np.allclose(gathered[i, :], i) for i in range(size))
    print("Gather", gathered[:, 0])
everyone = np.empty(size * 3, dtype=np.float64)
comm.Allgather(np.full(3, rank, dtype=np.float64), [everyone, MPI.DOUBLE])
print("Allgather", everyone)
blocks = np.arange(size * 2, dtype=np.int32) + 100 * rank
swapped = np.empty_like(blocks)
comm.Alltoall(blocks, swapped)
print("Alltoall", swapped)

# Reductions, IN_PLACE included.
total = np.empty(3)
comm.Allreduce(np.array([rank, 1.0, -rank]), total, op=MPI.SUM)
print("Allreduce", total)
inplace = np.array([rank + 1, 2 - rank], dtype=np.int64)
comm.Allreduce(MPI.IN_PLACE, inplace, op=MPI.MAX)
print("IN_PLACE", inplace)
prod = np.empty(2) if rank == 0 else None
comm.Reduce(np.array([rank + 1.0, 2.0]), prod, op=MPI.PROD, root=0)
if rank == 0:
    print("Reduce", prod)
flags = np.array([rank > 0, True])
comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.LAND)
bits = np.array([1 << rank], dtype=np.int32)
comm.Allreduce(MPI.IN_PLACE, bits, op=MPI.BOR)
print("logical", flags, bits)
part = np.empty(2)
comm.Reduce_scatter_block(np.arange(2 * size, dtype=np.float64) * (rank + 1), part, op=MPI.SUM)
print("Reduce_scatter_block", part)

# The v variants: rank r has r + 1 elements.
counts = [r + 1 for r in range(size)]
displs = [sum(counts[:r]) for r in range(size)]
mine = np.full(rank + 1, rank, dtype=np.float64)
allv = np.zeros(sum(counts))
comm.Allgatherv(mine, [allv, counts, displs, MPI.DOUBLE])
print("Allgatherv", allv)
rootv = np.zeros(sum(counts) + size) if rank == 0 else None
spread = [d + r for r, d in enumerate(displs)]  # a gap of one element after each block
comm.Gatherv(mine, [rootv, counts, spread, MPI.DOUBLE] if rank == 0 else None, root=0)
if rank == 0:
    print("Gatherv", rootv)
source = np.arange(sum(counts), dtype=np.float64) if rank == 0 else None
piece = np.empty(rank + 1)
comm.Scatterv([source, counts, displs, MPI.DOUBLE] if rank == 0 else None, piece, root=0)
print("Scatterv", piece)
send_counts = [1] * size
recv = np.empty(size, dtype=np.int64)
comm.Alltoallv(
    [np.arange(size, dtype=np.int64) + 10 * rank, send_counts, MPI.INT64_T],
    [recv, send_counts, list(range(size)), MPI.INT64_T],
)
print("Alltoallv", recv)

# MAXLOC and MINLOC on (value, index) pairs: a structured array with MPI.DOUBLE_INT.
pair = np.dtype([("value", np.float64), ("index", np.intc)], align=True)
values = np.array([(float((rank * 7) % size), rank), (float(-rank), rank)], dtype=pair)
best = np.empty_like(values)
comm.Allreduce([values, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MAXLOC)
print("MAXLOC", best.tolist())
comm.Allreduce([values, MPI.DOUBLE_INT], [best, MPI.DOUBLE_INT], op=MPI.MINLOC)
print("MINLOC", best.tolist())
ints = np.array([[rank % 2, rank]], dtype=np.intc)
low = np.empty_like(ints)
comm.Allreduce([ints, MPI.TWOINT], [low, MPI.TWOINT], op=MPI.MINLOC)
print("TWOINT", low)
