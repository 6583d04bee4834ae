"""The link of a rank to itself: a send is copied into its receive, or buffered."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from plait.transport.link import Message, Op, UndrivenLink, copy_bytes

if TYPE_CHECKING:
    from plait.transport.endpoint import Endpoint

__all__ = ["Loopback"]


class Loopback(UndrivenLink):
    """The link of a rank to itself: a send is copied into its receive, or buffered."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint

    def send(self, op: Op) -> None:
        """Deliver ``op`` to a posted receive of this rank, else buffer a copy; op completes."""
        ep = self._ep
        recv = ep.take_posted(op.peer, op.tag)
        if recv is not None:
            err = ep.mismatch(recv, op.check, op.nbytes)
            if err is not None:
                ep.fail(recv, err)
            else:
                copy_bytes(recv.buf, recv.arr, 0, op.buf, op.arr, 0, op.nbytes)
                ep.bytes_received += op.nbytes
                ep.complete(recv)
        else:
            msg = Message(self, op.check, op.nbytes)
            assert msg.data is not None
            msg.data[:] = np.frombuffer(op.buf, dtype=np.uint8)
            msg.received, msg.complete = op.nbytes, True
            ep.add_unexpected(op.peer, op.tag, msg)
        ep.bytes_sent += op.nbytes
        ep.complete(op)

    def recv_posted(self, op: Op) -> None:
        """Nothing to do: a later send to self finds the receive."""

    def claim(self, op: Op, msg: Message) -> None:
        """Copy the buffered message into ``op``."""
        self._ep.deliver_buffered(op, msg)

    def reject(self, msg: Message, err: BaseException) -> None:
        """Drop the buffered message."""

    def cancel(self, op: Op) -> None:
        """Nothing to do: sends to self complete at once."""

    def shutdown(self, err: BaseException) -> None:
        """Nothing held."""

    def release(self) -> None:
        """Nothing held."""
