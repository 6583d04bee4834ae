"""mpi4py's tutorial on Python objects: point to point, blocking and not, and collectives.

Run with 2 or more ranks: ``plait run -n 4 --mpi4py examples/mpi4py/objects.py``.
"""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

# Point-to-point communication of a dictionary (the tutorial's first example).
if rank == 0:
    data = {"a": 7, "b": 3.14}
    comm.send(data, dest=1, tag=11)
elif rank == 1:
    data = comm.recv(source=0, tag=11)
    print("received", sorted(data.items()))

# Non-blocking, with a request.
if rank == 0:
    req = comm.isend({"a": 7, "b": 3.14}, dest=1, tag=12)
    req.wait()
elif rank == 1:
    req = comm.irecv(source=0, tag=12)
    print("irecv", sorted(req.wait().items()))

# A status says who sent what, with which tag.
status = MPI.Status()
if rank != 0:
    comm.send([rank] * rank, dest=0, tag=100 + rank)
else:
    got = {}
    for _ in range(size - 1):
        obj = comm.recv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
        got[status.Get_source()] = (status.Get_tag(), obj)
    print("from any source", sorted(got.items()))

# Broadcasting a dictionary, scattering and gathering lists.
data = {"key1": [7, 2.72, 2 + 3j], "key2": ("abc", "xyz")} if rank == 0 else None
data = comm.bcast(data, root=0)
print("bcast", data["key1"], data["key2"])

data = [(i + 1) ** 2 for i in range(size)] if rank == 0 else None
data = comm.scatter(data, root=0)
assert data == (rank + 1) ** 2
print("scatter", data)

data = comm.gather((rank + 1) ** 2, root=0)
if rank == 0:
    assert data == [(i + 1) ** 2 for i in range(size)]
print("gather", data)

print("allgather", comm.allgather(rank * 10))
print("alltoall", comm.alltoall([f"{rank}->{j}" for j in range(size)]))
print("reduce", comm.reduce(rank + 1, op=MPI.PROD, root=size - 1))
print("allreduce", comm.allreduce(rank, op=MPI.SUM), comm.allreduce(rank, op=MPI.MAX))
print("lists", comm.allreduce([rank], op=MPI.SUM))
print("maxloc", comm.allreduce((rank % 2, rank), op=MPI.MAXLOC))
print("minloc", comm.allreduce((rank % 2, rank), op=MPI.MINLOC))
print("function", comm.allreduce(str(rank), op=lambda a, b: a + b))

# sendrecv around a ring, and requests waited on together.
right, left = (rank + 1) % size, (rank - 1) % size
print("sendrecv", comm.sendrecv(f"from {rank}", dest=right, source=left))
reqs = [comm.irecv(source=left, tag=7), comm.isend(rank, dest=right, tag=7)]
print("waitall", MPI.Request.waitall(reqs))
