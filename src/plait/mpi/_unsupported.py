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
    "Scan": "allgather, then a cumulative sum (numpy.cumsum)",
    "Exscan": "allgather, then a cumulative sum (numpy.cumsum)",
    "Iscan": "allgather, then a cumulative sum (numpy.cumsum)",
    "Iexscan": "allgather, then a cumulative sum (numpy.cumsum)",
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
    "waitsome": "waitany in a loop, or waitall",
    "testsome": "testany in a loop, or testall",
    "Get_status_all": "Testall (with statuses)",
    "Get_status_any": "Testany (with a status)",
    "Get_status_some": "Testany in a loop (with a status)",
    "get_status_all": "testall",
    "get_status_any": "testany",
    "get_status_some": "testany in a loop",
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
    "Ialltoallw": "Alltoallv (blocking)",
    "Neighbor_allgather": "Sendrecv with the neighbours",
    "Neighbor_alltoall": "Sendrecv with the neighbours",
    "Sendrecv_replace": "Sendrecv into a second buffer",
    "Intercomm_merge": "Split",
    "Compare": "Get_size and Get_rank (no groups to compare)",
    "Split_type": "Split, with a color per host (from Get_processor_name)",
    "Set_errhandler": "nothing (errors raise exceptions, as under mpi4py's default)",
    "Get_errhandler": "nothing (errors raise exceptions, as under mpi4py's default)",
    "Create_intercomm": "Split",
    "Attach_buffer": "Isend",
    "Create_contiguous": "a numpy dtype of several elements, or count times the elements",
    "Create_vector": "a numpy view with strides, copied to a contiguous array",
    "Create_struct": "a numpy structured dtype, sent as bytes",
    "Create_subarray": "a numpy slice, copied to a contiguous array",
    "Create_indexed": "numpy fancy indexing, copied to a contiguous array",
    "Create_resized": "a numpy structured dtype with the padding you need",
    "Commit": "nothing (no derived datatypes to commit)",
    "Get_attr": "nothing (no attributes; Get_size and Get_rank for the basics)",
    "Get_error_string": "the plait exception's message (errors are raised, not coded)",
    "Agree": "plait's own Communicator.agree (plait.mpi has no fault tolerance)",
    "Iagree": "plait's own Communicator.agree (plait.mpi has no fault tolerance)",
    "Shrink": "plait's own Communicator.shrink (plait.mpi has no fault tolerance)",
    "Connect": "plait run (no dynamic processes: ranks are fixed when the job starts)",
    "Accept": "plait run (no dynamic processes: ranks are fixed when the job starts)",
    "Intercomm": "Intracomm (no intercommunicators: Split)",
    "Cartcomm": "Intracomm (no topologies: compute neighbours from the rank)",
    "Graphcomm": "Intracomm (no topologies: compute neighbours from the rank)",
    "Distgraphcomm": "Intracomm (no topologies: compute neighbours from the rank)",
    "Grequest": "Request (no generalized requests)",
    "Prequest": "Request (no persistent requests: Isend or Irecv each time)",
    "Is_thread_main": "threading.current_thread() is threading.main_thread()",
    "FLOAT16_T": "the numpy float16 array alone (its dtype is the datatype)",
    "BFLOAT16_T": "the ml_dtypes bfloat16 array alone (its dtype is the datatype)",
}

#: mpi4py's datatypes that are another name for one plait.mpi has (Fortran's and C++'s
#: names, and C's sized floats): the same size and kind of element.
TWINS: dict[str, str] = {
    "INTEGER1": "INT8_T",
    "INTEGER2": "INT16_T",
    "INTEGER4": "INT32_T",
    "INTEGER8": "INT64_T",
    "SINT8_T": "INT8_T",
    "SINT16_T": "INT16_T",
    "SINT32_T": "INT32_T",
    "SINT64_T": "INT64_T",
    "REAL4": "FLOAT",
    "REAL8": "DOUBLE",
    "FLOAT32_T": "FLOAT",
    "FLOAT64_T": "DOUBLE",
    "COMPLEX8": "C_FLOAT_COMPLEX",
    "COMPLEX16": "C_DOUBLE_COMPLEX",
    "F_INT": "INT",
    "F_FLOAT": "FLOAT",
    "F_DOUBLE": "DOUBLE",
    "F_BOOL": "C_BOOL",
    "F_COMPLEX": "C_FLOAT_COMPLEX",
    "F_FLOAT_COMPLEX": "C_FLOAT_COMPLEX",
    "F_DOUBLE_COMPLEX": "C_DOUBLE_COMPLEX",
    "CXX_BOOL": "C_BOOL",
    "CXX_FLOAT_COMPLEX": "C_FLOAT_COMPLEX",
    "CXX_DOUBLE_COMPLEX": "C_DOUBLE_COMPLEX",
    "CXX_LONG_DOUBLE_COMPLEX": "C_LONG_DOUBLE_COMPLEX",
    "CHARACTER": "CHAR",
}


class Unsupported(NotImplementedError, AttributeError):
    """A part of mpi4py that plait.mpi does not provide (see docs/mpi.md for what it does)."""


def unsupported(where: str, name: str, supported: Iterable[str]) -> Unsupported:
    """The error for ``where.name``, with the nearest supported call (Note [nearest])."""
    hint = NEAREST.get(where) if where == "Op" else NEAREST.get(name)  # no user-defined ops
    if hint is None:
        twin = TWINS.get(name)
        hint = f"{twin} (the same elements)" if twin else _spelled_alike(name, supported)
    text = f"plait.mpi does not support {where}.{name}"
    text += f"; nearest supported: {hint}" if hint else "; see docs/mpi.md for what is supported"
    return Unsupported(text)


def _spelled_alike(name: str, supported: Iterable[str]) -> str | None:
    """The supported call spelled most like ``name``, if it is the same kind of call.

    Note [nearest]
        A nonblocking or persistent form of a supported call (``Iallgatherv``,
        ``Allreduce_init``) gets the blocking call. Otherwise, a name spelled
        like a supported one is often another thing entirely:
        constants most of all (``IDENT`` is a result of Compare, not ``INT``;
        ``COMPLEX16`` holds twice the bytes of ``COMPLEX``), and calls whose
        verbs differ (``Set_error`` is not ``Get_error``). So a constant gets
        a hint only from the tables (``NEAREST``, ``TWINS``), and a spelled-
        alike call only where its verb (the part before the first ``_``) is
        the name's and the rest is spelled alike too; otherwise the message
        points to docs/mpi.md.
    """
    if not any(ch.islower() for ch in name):
        return None
    supported = list(supported)
    if name[:1] == "I" and name[1:].capitalize() in supported:
        return f"{name[1:].capitalize()} (blocking)"  # a nonblocking collective
    if name.endswith("_init") and name[:-5] in supported:
        return f"{name[:-5]} (called each time)"  # a persistent one
    if "_" not in name:
        close = difflib.get_close_matches(name, supported, n=1, cutoff=0.75)
        return close[0] if close else None
    verb, rest = name.split("_", 1)  # what it does, and to what: both alike
    kin = {s.split("_", 1)[1]: s for s in supported if s.split("_", 1)[0] == verb and "_" in s}
    close = difflib.get_close_matches(rest, list(kin), n=1, cutoff=0.6)
    return kin[close[0]] if close else None


class Unlisted(type):
    """The type of plait.mpi's classes (``Comm``, ``Datatype``, ``Request``, ``Status``,
    ``Op``): an mpi4py name they lack, looked up on the class (``MPI.Request.Waitsome``,
    ``MPI.Comm.Get_parent``) or, through the class's own ``__getattr__``, on an instance,
    raises :class:`Unsupported` naming it, as the module's does, not a bare
    AttributeError."""

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
