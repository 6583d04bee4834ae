"""Run several mpi4py scripts in one job; each rank writes each script's output to a file.

    mpirun -np 4 python run_scripts.py OUT a.py b.py        # real mpi4py
    plait run -n 4 --mpi4py run_scripts.py OUT a.py b.py    # the same, on plait.mpi

One job for all the scripts keeps the start-up cost (an MPI job's, or plait's) to one.
Each script runs as ``__main__`` after a barrier, with its standard output captured, and
rank r writes it to ``OUT/<script stem>.<r>.txt``: files, not the launcher's interleaved
stream, so the two runs compare rank by rank.
"""

import contextlib
import io
import runpy
import sys
from pathlib import Path

from mpi4py import MPI

out = Path(sys.argv[1])
comm = MPI.COMM_WORLD
for script in sys.argv[2:]:
    comm.Barrier()
    captured = io.StringIO()
    saved = sys.argv
    sys.argv = [script]
    try:
        with contextlib.redirect_stdout(captured):
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved
    (out / f"{Path(script).stem}.{comm.Get_rank()}.txt").write_text(captured.getvalue())
comm.Barrier()
