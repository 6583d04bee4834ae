"""A master-worker queue: rank 0 hands out tasks and takes results as they come, from any
worker (``ANY_SOURCE``), telling each worker to stop with a tag when the queue is empty.

    plait run -n 4 --mpi4py examples/mpi4py/master_worker.py
"""

from mpi4py import MPI

TASK, RESULT, STOP = 1, 2, 3

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size = comm.Get_size()

if rank == 0:
    todo = list(range(20))
    results = {}
    done_by = {w: 0 for w in range(1, size)}
    active = 0
    for worker in range(1, size):
        if todo:
            comm.send(todo.pop(), dest=worker, tag=TASK)
            active += 1
        else:
            comm.send(None, dest=worker, tag=STOP)
    status = MPI.Status()
    while active:
        task, value = comm.recv(source=MPI.ANY_SOURCE, tag=RESULT, status=status)
        results[task] = value
        done_by[status.Get_source()] += 1
        if todo:
            comm.send(todo.pop(), dest=status.Get_source(), tag=TASK)
        else:
            comm.send(None, dest=status.Get_source(), tag=STOP)
            active -= 1
    assert sum(done_by.values()) == 20
    print("results", [results[t] for t in sorted(results)])
    print("sum of squares", sum(results.values()))
else:
    status = MPI.Status()
    while True:
        task = comm.recv(source=0, tag=MPI.ANY_TAG, status=status)
        if status.Get_tag() == STOP:
            break
        comm.send((task, task * task), dest=0, tag=RESULT)
comm.Barrier()
