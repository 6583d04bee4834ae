"""The types the collectives' signatures share, for the type checker only.

:mod:`plait._edge` (the even collectives) and :mod:`plait._uneven_edge` (the
uneven ones) spell their overloads with these, so one definition keeps the two
alike. Everything here is under ``TYPE_CHECKING``: nothing runs at import, and
``typing_extensions`` (for the type variables' defaults) is needed by the type
checker only.

How the overloads read them (see Note [result types] in
:mod:`plait.communicator`): a torch tensor ``x`` gives a tensor, anything else
a numpy array, ``out=`` gives ``out`` itself (the type variables' defaults say
which applies when ``out`` is omitted); ``async_op=True`` gives a
:class:`plait.Work` of that; a plain ``bool`` for ``async_op`` gives either,
so it is typed ``Any``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# Names for the type checker: defined under TYPE_CHECKING below, absent at run time.
__all__ = [
    "Async",
    "Blocking",
    "CompressedAsync",
    "CompressedBlocking",
    "CompressedEither",
    "Either",
    "RowCounts",
]

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Literal, NotRequired, TypedDict

    import numpy as np
    from numpy.typing import NDArray
    from torch import Tensor
    from typing_extensions import TypeVar

    from plait._compressed import Compression

    #: The result for a tensor ``x``: ``out``'s type when given, else a tensor.
    _T = TypeVar("_T", default=Tensor)
    #: The result for any other ``x``: ``out``'s type when given, else a numpy array.
    _A = TypeVar("_A", default=NDArray[Any])
    #: What broadcast fills and returns: ``x`` itself.
    _X = TypeVar("_X")
    #: Rows per rank of an uneven collective: a sequence of ints or a 1-D integer array.
    RowCounts = Sequence[int] | NDArray[np.integer[Any]]

    class Blocking(TypedDict, total=False):
        """The options of a call that returns its result (``async_op=False``, the default)."""

        algorithm: str
        timeout: float | None
        async_op: Literal[False]

    class Async(TypedDict):
        """The options of a call that returns a :class:`plait.Work` (``async_op=True``)."""

        async_op: Literal[True]
        algorithm: NotRequired[str]
        timeout: NotRequired[float | None]

    class Either(TypedDict):
        """The options of a call whose ``async_op`` is a ``bool`` known only at run time."""

        async_op: bool
        algorithm: NotRequired[str]
        timeout: NotRequired[float | None]

    class CompressedBlocking(Blocking, total=False):
        """allreduce's blocking options, with ``compression=``."""

        compression: Compression | None

    class CompressedAsync(Async, total=False):
        """allreduce's async options, with ``compression=``."""

        compression: Compression | None

    class CompressedEither(Either, total=False):
        """allreduce's options for a run-time ``async_op``, with ``compression=``."""

        compression: Compression | None
