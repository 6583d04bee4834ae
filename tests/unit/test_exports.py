"""The public surface is pinned: additions are deliberate, removals are breaking."""

import numpy as np
import pytest

import plait

EXPECTED = {
    "ANY_SOURCE",
    "ANY_TAG",
    "PROC_NULL",
    "Request",
    "Status",
    "wait_all",
    "wait_any",
    "AVG",
    "BAND",
    "BOR",
    "BXOR",
    "COLLECTIVES",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "AbortedError",
    "Agreement",
    "ClosedError",
    "CollectiveTimeout",
    "CommError",
    "CommTimeout",
    "Communicator",
    "ExcludedError",
    "ForkedError",
    "InternalError",
    "MismatchError",
    "Op",
    "PeerLostError",
    "RendezvousError",
    "Stats",
    "TransportError",
    "UnsupportedError",
    "Work",
    "__version__",
    "algorithms",
    "init",
    "restart_count",
}


def test_public_names() -> None:
    assert set(plait.__all__) == EXPECTED
    for name in EXPECTED:
        assert hasattr(plait, name)


def test_algorithm_names() -> None:
    assert set(plait.algorithms("allreduce")) == {
        "ring",
        "recursive_doubling",
        "rabenseifner",
        "binomial",
        "double_binary_tree",
        "swing",
        "direct",
        "hierarchical",
        "cascade",
        "hierarchical_arena",
        "cascade_arena",
        "in_network",
        "arena",
        "arena_oneshot",
        "arena_leader",
    }
    assert set(plait.algorithms("reduce_scatter")) == {
        "ring",
        "recursive_halving",
        "pairwise",
        "arena",
    }
    assert set(plait.algorithms("allgather")) == {"ring", "recursive_doubling", "bruck", "arena"}
    assert set(plait.algorithms("broadcast")) == {"binomial", "scatter_allgather", "arena"}
    assert set(plait.algorithms("reduce")) == {"binomial", "rabenseifner", "arena"}
    assert set(plait.algorithms("alltoall")) == {"pairwise", "bruck", "arena"}
    assert set(plait.algorithms("gather")) == {"binomial", "arena"}
    assert set(plait.algorithms("scatter")) == {"binomial", "arena"}
    assert set(plait.algorithms("barrier")) == {"dissemination", "arena"}


def test_communicator_methods() -> None:
    for name in (
        "allreduce",
        "reduce",
        "broadcast",
        "reduce_scatter",
        "allgather",
        "alltoall",
        "gather",
        "scatter",
        "barrier",
        "send",
        "recv",
        "close",
        "rank",
        "size",
    ):
        assert hasattr(plait.Communicator, name), name


def test_user_op() -> None:
    op = plait.Op(np.logaddexp, commutative=True)
    assert op.commutative
    assert op.name == "logaddexp"
    assert not plait.Op(np.subtract, commutative=False).commutative


def test_algorithm_names_are_strings_that_mark_simulator_only_ones() -> None:
    """The listing stays a tuple of str; in_network is marked as needing aggregating switches."""
    names = plait.algorithms("allreduce")
    assert all(isinstance(n, str) for n in names)
    assert [n for n in names if n.simulator_only] == ["in_network"]
    (sim,) = (n for n in names if n == "in_network")
    assert sim == "in_network"
    assert hash(sim) == hash("in_network")
    assert str(sim) == f"{sim}" == "in_network"
    assert repr(sim) == "'in_network' (simulator only: needs aggregating switches)"
    assert repr(plait.algorithms("allreduce")[0]) == repr(str(names[0]))
    assert "simulator only" in repr(names)  # a listing printed at the prompt shows it
    for c in plait.COLLECTIVES:  # only in_network is marked anywhere
        assert all(not n.simulator_only for n in plait.algorithms(c) if n != "in_network")


def test_simulator_only_algorithms_are_refused_by_a_communicator() -> None:
    from plait.testing import memory_communicators

    sim = next(n for n in plait.algorithms("allreduce") if n.simulator_only)
    (comm,) = memory_communicators(1)
    with comm, pytest.raises(plait.UnsupportedError, match=r"plait\.sim"):
        comm.allreduce(np.ones(2), algorithm=sim)
