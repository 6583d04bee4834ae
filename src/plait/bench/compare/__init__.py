"""The systems ``plait bench --compare`` measures next to plait, one worker module each.

- :mod:`plait.bench.compare.mpi_worker`: mpi4py over Open MPI, started by
  ``mpirun`` (once with its shared-memory transport, once with TCP);
- :mod:`plait.bench.compare.gloo_worker`: torch.distributed's gloo backend,
  started by ``plait run``'s launcher.

Each runs the same :func:`plait.bench.loop.run_sweep` as plait's worker and
reports its rows as JSON in the file the sweep description names.
"""

__all__: list[str] = []
