"""Hello world, the first mpi4py tutorial program: every rank says who it is.

mpirun -np 4 python examples/mpi4py/hello.py          # with mpi4py and an MPI library
plait run -n 4 --mpi4py examples/mpi4py/hello.py      # the same script, on plait
"""

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()
print(f"Hello, World! I am process {rank} of {size}.")
assert (comm.rank, comm.size) == (rank, size)
assert isinstance(MPI.Get_processor_name(), str)
t0 = MPI.Wtime()
comm.Barrier()
comm.barrier()
assert MPI.Wtime() >= t0
