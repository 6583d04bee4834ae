"""The public surface is pinned: additions are deliberate, removals are breaking."""

import numpy as np

import plait

EXPECTED = {
    "AVG",
    "BAND",
    "BOR",
    "BXOR",
    "COLLECTIVES",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "ClosedError",
    "CollectiveTimeout",
    "CommError",
    "CommTimeout",
    "Communicator",
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
        "in_network",
    }
    assert set(plait.algorithms("reduce_scatter")) == {"ring", "recursive_halving", "pairwise"}
    assert set(plait.algorithms("allgather")) == {"ring", "recursive_doubling", "bruck"}
    assert set(plait.algorithms("broadcast")) == {"binomial", "scatter_allgather"}
    assert set(plait.algorithms("reduce")) == {"binomial", "rabenseifner"}
    assert set(plait.algorithms("alltoall")) == {"pairwise", "bruck"}
    assert plait.algorithms("gather") == ("binomial",)
    assert plait.algorithms("scatter") == ("binomial",)
    assert plait.algorithms("barrier") == ("dissemination",)


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
