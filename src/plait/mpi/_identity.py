"""What an mpi4py communicator says of itself, moving nothing: its name (``Get_name``,
``Set_name``, ``name``), that it is an intracommunicator (``Is_intra``, ``Is_inter``), and
MPI's predefined attribute ``TAG_UB`` (``Get_attr``). A mixin of :class:`plait.mpi.Comm`.

Note [communicator attributes]
    Open MPI caches the predefined attributes (``TAG_UB``, the largest tag) on
    ``COMM_WORLD``, and ``MPI_Comm_dup`` copies a communicator's attributes, so mpi4py's
    ``Get_attr(MPI.TAG_UB)`` is ``2**31 - 1`` on the world and on what its ``Dup`` makes
    (and theirs), but None on ``COMM_SELF`` and on what ``Split`` makes. plait.mpi says
    the same: a communicator ``_has_attrs`` where it is the world or a ``Dup`` of one that
    has; plait's tags go to ``2**31 - 1``, Open MPI's bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plait.mpi._errors import mpi_error
from plait.mpi._requests import read_count
from plait.mpi._unsupported import Unsupported

__all__ = ["TAG_UB", "CommIdentity"]

#: mpi4py's ``MPI.TAG_UB``: the key of the attribute that holds the largest tag (Open MPI's).
TAG_UB = 0
#: The largest tag a message may have, in plait as in Open MPI.
_LARGEST_TAG = 2**31 - 1
#: Open MPI's ``MPI_MAX_OBJECT_NAME`` (64) less its NUL: the longest name kept, in bytes.
_LONGEST_NAME = 63


class CommIdentity:
    """``Get_name``, ``Set_name``, ``Is_intra``, ``Is_inter`` and ``Get_attr`` of
    :class:`plait.mpi.Comm` (Note [communicator attributes])."""

    if TYPE_CHECKING:
        _name: str
        _handle_freed: bool
        _has_attrs: bool

        def __bool__(self) -> bool: ...

    def _refuse_null(self, call: str) -> None:
        """Raise MPI_ERR_COMM, as mpi4py's, where this is COMM_NULL (or a freed handle)."""
        if not self:
            raise mpi_error(
                "ERR_COMM",
                f"{call}: MPI_ERR_COMM: invalid communicator (COMM_NULL, or a freed one)",
            )

    def Get_name(self) -> str:
        """The communicator's name: ``MPI_COMM_WORLD`` for the world, ``''`` for one that
        ``Split`` or ``Dup`` made until ``Set_name``; a handle ``Free`` freed is COMM_NULL's."""
        return "MPI_COMM_NULL" if self._handle_freed else self._name

    def Set_name(self, name: str | bytes) -> None:
        """Name the communicator (every handle to it sees the name), as MPI_Comm_set_name:
        Open MPI keeps the first 63 bytes.

        Raises:
            TypeError: ``name`` is not a str or bytes.
            ValueError: this is COMM_NULL: ``MPI.Exception`` of class ``ERR_COMM``.
        """
        if not isinstance(name, str | bytes):
            raise TypeError(f"Set_name: name must be a str; got {type(name).__name__}")
        self._refuse_null("Set_name")
        raw = name if isinstance(name, bytes) else name.encode()
        self._name = raw[:_LONGEST_NAME].decode(errors="ignore")

    @property
    def name(self) -> str:
        """The communicator's name (:meth:`Get_name`; setting it is :meth:`Set_name`)."""
        return self.Get_name()

    @name.setter
    def name(self, value: str | bytes) -> None:
        self.Set_name(value)

    def Is_inter(self) -> bool:
        """False: plait.mpi's communicators are all intracommunicators."""
        self._refuse_null("Is_inter")
        return False

    def Is_intra(self) -> bool:
        """True: plait.mpi's communicators are all intracommunicators."""
        self._refuse_null("Is_intra")
        return True

    @property
    def is_inter(self) -> bool:
        """:meth:`Is_inter`."""
        return self.Is_inter()

    @property
    def is_intra(self) -> bool:
        """:meth:`Is_intra`."""
        return self.Is_intra()

    def Get_attr(self, keyval: Any) -> int | None:
        """The value of MPI's predefined attribute ``keyval``: for ``MPI.TAG_UB`` the largest
        tag, on the world and what its ``Dup`` makes, None elsewhere, as Open MPI's (Note
        [communicator attributes]).

        Raises:
            Unsupported: another key (plait.mpi has no other attribute).
            ValueError: this is COMM_NULL: ``MPI.Exception`` of class ``ERR_COMM``.
        """
        key = read_count(keyval)
        self._refuse_null("Get_attr")
        if key != TAG_UB:
            raise Unsupported(
                f"plait.mpi does not support Comm.Get_attr({key}); nearest supported: "
                "Get_attr(MPI.TAG_UB), the only attribute plait.mpi has"
            )
        return _LARGEST_TAG if self._has_attrs else None
