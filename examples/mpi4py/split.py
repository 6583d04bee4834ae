"""Sub-communicators: Split by color and key, Dup, Free, and COMM_NULL for MPI.UNDEFINED.

plait run -n 4 --mpi4py examples/mpi4py/split.py
"""

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

# Even and odd ranks, each group in reverse order of world rank.
half = comm.Split(color=rank % 2, key=-rank)
total = np.zeros(1)
half.Allreduce(np.array([float(rank)]), total, op=MPI.SUM)
print("split", half.Get_rank(), half.Get_size(), total[0], half.allgather(rank))
half.Free()
assert half == MPI.COMM_NULL

# Only rank 0 stays out of the group.
group = comm.Split(MPI.UNDEFINED if rank == 0 else 0, rank)
if rank == 0:
    assert group == MPI.COMM_NULL
    print("not in the group")
else:
    print("group of", group.Get_size(), "sum", group.allreduce(rank))
    group.Free()

# A duplicate: the same ranks, messages apart from the world's.
dup = comm.Dup()
if size > 1:
    if rank == 0:
        dup.send("on dup", dest=1, tag=0)
        comm.send("on world", dest=1, tag=0)
    elif rank == 1:
        print(comm.recv(source=0, tag=0), dup.recv(source=0, tag=0))
print("dup", dup.Get_rank() == rank, dup.bcast(rank * 3, root=size - 1))
dup.Free()
