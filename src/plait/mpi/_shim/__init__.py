"""The folder that ``plait run --mpi4py`` puts first on the ranks' PYTHONPATH.

:func:`plait.mpi.mpi4py_path` names it.

It holds one package, ``mpi4py``, whose ``MPI`` module is :mod:`plait.mpi`: with it on the
path, an unchanged ``from mpi4py import MPI`` runs on plait. Nothing else is in the folder,
so no other import changes.
"""
