"""What plait.mpi says about the parts of mpi4py it does not have: the call and the nearest one.

An attribute of ``plait.mpi`` or of a communicator that mpi4py has and plait.mpi does not
raises :class:`Unsupported`, a ``NotImplementedError`` (what the error means) that is also
an ``AttributeError`` (so ``hasattr(MPI, "Ibcast")`` is False and feature checks that use it
take their fallback). The message names the call and the closest supported call.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

__all__ = ["Unlisted", "Unsupported", "unsupported"]

#: The nearest supported call for the mpi4py names people reach for most.
NEAREST: dict[str, str] = {
    "Ibcast": "Bcast (blocking)",
    "Ireduce": "Reduce (blocking)",
    "Iallreduce": "Allreduce (blocking)",
    "Igather": "Gather (blocking)",
    "Iallgather": "Allgather (blocking)",
    "Iscatter": "Scatter (blocking)",
    "Ialltoall": "Alltoall (blocking)",
    "Ibarrier": "Barrier (blocking)",
    "Scan": "allgather, then a cumulative sum (numpy.cumsum)",
    "Exscan": "allgather, then a cumulative sum (numpy.cumsum)",
    "scan": "allgather, then itertools.accumulate",
    "exscan": "allgather, then itertools.accumulate",
    "ssend": "send",
    "Ssend": "Send",
    "Bsend": "Send",
    "Rsend": "Send",
    "issend": "isend",
    "Issend": "Isend",
    "ibsend": "isend",
    "Ibsend": "Isend",
    "mprobe": "probe, then recv from its source and tag",
    "Mprobe": "Probe, then Recv from its source and tag",
    "improbe": "iprobe, then recv from its source and tag",
    "Create_cart": "Split (no topologies: compute neighbours from the rank)",
    "Create_graph": "Split (no topologies)",
    "Create_dist_graph": "Split (no topologies)",
    "Create": "Split",
    "Waitsome": "Waitany in a loop, or Waitall",
    "Testsome": "Testany in a loop, or Testall",
    "Create_group": "Split",
    "Get_group": "Split (no groups: pick ranks with a color)",
    "Spawn": "plait run -n N (ranks are fixed when the job starts)",
    "Win": "the collectives (no one-sided windows in plait.mpi)",
    "File": "numpy's own file I/O per rank",
    "Pack": "numpy arrays of structured dtype",
    "Unpack": "numpy arrays of structured dtype",
    "Op": "MPI.SUM, ... or a Python function to the lowercase reduce/allreduce",
    "REPLACE": "a Python function (lambda a, b: b) to the lowercase reduce/allreduce",
    "NO_OP": "a Python function (lambda a, b: a) to the lowercase reduce/allreduce",
    "Alltoallw": "Alltoallv",
    "Neighbor_allgather": "Sendrecv with the neighbours",
    "Neighbor_alltoall": "Sendrecv with the neighbours",
    "Sendrecv_replace": "Sendrecv into a second buffer",
    "Intercomm_merge": "Split",
    "Create_intercomm": "Split",
    "Attach_buffer": "Isend",
    "Query_thread": "plait.mpi calls from several threads each need their own communicator",
    "Create_contiguous": "a numpy dtype of several elements, or count times the elements",
    "Create_vector": "a numpy view with strides, copied to a contiguous array",
    "Create_struct": "a numpy structured dtype, sent as bytes",
    "Create_subarray": "a numpy slice, copied to a contiguous array",
    "Create_indexed": "numpy fancy indexing, copied to a contiguous array",
    "Create_resized": "a numpy structured dtype with the padding you need",
    "Commit": "nothing (no derived datatypes to commit)",
    "Get_attr": "nothing (no attributes; Get_size and Get_rank for the basics)",
    "Get_error_string": "the plait exception's message (errors are raised, not coded)",
}


class Unsupported(NotImplementedError, AttributeError):
    """A part of mpi4py that plait.mpi does not provide (see docs/mpi.md for what it does)."""


def unsupported(where: str, name: str, supported: Iterable[str]) -> Unsupported:
    """The error for ``where.name``, with the nearest supported call."""
    hint = NEAREST.get(where) if where == "Op" else NEAREST.get(name)  # no user-defined ops
    if hint is None:
        close = difflib.get_close_matches(name, list(supported), n=1, cutoff=0.6)
        hint = close[0] if close else None
    text = f"plait.mpi does not support {where}.{name}"
    text += f"; nearest supported: {hint}" if hint else "; see docs/mpi.md for what is supported"
    return Unsupported(text)


class Unlisted(type):
    """The type of plait.mpi's classes (``Request``, ``Status``, ``Op``): an mpi4py name they
    lack, looked up on the class (``MPI.Request.Waitsome``) or, through the class's own
    ``__getattr__`` (:func:`lacking`), on an instance, raises :class:`Unsupported` naming
    it, as the module's and ``Comm``'s do, not a bare AttributeError."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise unsupported(cls.__name__, name, (n for n in dir(cls) if not n.startswith("_")))


def lacking(self: object, name: str) -> Any:
    """A class's ``__getattr__`` for names its instances lack: as :class:`Unlisted`."""
    if name.startswith("_"):
        raise AttributeError(name)
    kind = type(self)
    raise unsupported(kind.__name__, name, (n for n in dir(kind) if not n.startswith("_")))
