"""Start a job's ranks on this host and watch over them: the machinery of ``plait run``.

::

    from plait.launch import Job, launch, module_command

    code = launch(Job(module_command("mypkg.train", "--epochs", "3"), nproc=4))

:func:`launch` starts ``nproc`` processes of one command, serves the job's TCP store (on
node 0), gives every rank its identity in ``PLAIT_*`` variables, relays their output a
whole line at a time (:mod:`plait.launch.relay`), has every rank dump its flight recorder
when one reports a stall (:mod:`plait.launch.stall`), stops the job when a rank fails and
names the rank that started the failure (:mod:`plait.launch.watch`), and returns the
job's exit code. ``plait run`` and ``plait bench`` both launch through it; it imports
nothing of plait above the rendezvous layer and the diagnostics.
"""

from __future__ import annotations

from plait.launch.job import TRANSPORTS as TRANSPORTS
from plait.launch.job import Job as Job
from plait.launch.job import StartError as StartError
from plait.launch.job import launch as launch
from plait.launch.job import module_command as module_command

__all__ = ["TRANSPORTS", "Job", "StartError", "launch", "module_command"]
