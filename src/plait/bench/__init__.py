"""``plait bench``: a benchmark of plait's collectives in the style of nccl-tests.

The bench process (:mod:`plait.cli.bench`) starts the ranks, collects their
timings and prints the table. What runs where:

- :mod:`plait.bench.sweep`: sizes, element counts, the iteration policy and the
  bus-bandwidth factors (pure functions, shared by every runner);
- :mod:`plait.bench.data`: each rank's input pattern and the wrong-element check
  against :func:`plait.testing.reference`;
- :mod:`plait.bench.loop`: the measuring loop every system's worker runs;
- :mod:`plait.bench.worker`: the plait rank body (started through ``plait run``'s
  launcher); :mod:`plait.bench.compare`: the same sweep through mpi4py and
  torch.distributed's gloo backend;
- :mod:`plait.bench.limits`: this machine's memory and loopback limits;
- :mod:`plait.bench.runner`: launches each system and reads its results back;
- :mod:`plait.bench.progress`: each row on stderr as it is measured, the time
  left, the rows kept for an interrupted run;
- :mod:`plait.bench.report`: table, JSON, CSV and plot (``plait sim`` prints
  its tables with it too);
- :mod:`plait.bench.options`: the options ``plait bench`` and ``plait sim``
  share, spelled alike.
"""

__all__: list[str] = []
