"""The short path of a repeated call: its request made in a few operations.

A loop repeats a few calls of one shape; :class:`Shortcut` keeps what the first call of
a shape worked out (Note [the short path]) so that the API edge makes a later call's
:class:`~plait._request.Request` without the checks, the algorithm choice and the
plan lookup, and hands it to the call runner's frame for its plan where there is one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from plait._request import Request
from plait.runtime.scratch import empty_of

__all__ = ["Shortcut", "separate"]

_new = tuple.__new__  # a named tuple made from a tuple, without the keyword machinery


class Shortcut:
    """Makes the request of a repeated call in a few operations (Note [the short path]).

    Note [the short path]
        A loop repeats a few calls of one shape. The first call of a shape
        goes the whole way (checks, algorithm choice, plan, staging); where its
        arguments were the simple kind (a contiguous numpy array in native byte
        order; ``out`` None, ``x`` itself or another numpy array of x's dtype;
        and no staging was needed) the edge keeps a Shortcut under the key of
        everything the checks read: collective, shape, dtype, op, root, what
        ``out`` is (none, ``x``, or an array's shape and dtype), algorithm. A
        later call with the same key is then only tested for what the key
        cannot say (that ``x`` is contiguous; that ``out`` is writable, and,
        when it is another array, contiguous and apart from ``x``:
        :func:`separate`), and its request is made here, with the same plan,
        spec and result rules as the first one's. ``broadcast`` keeps one
        under (collective, shape, dtype, root, algorithm) for a writable
        contiguous ``x`` (:meth:`request_fill`), ``scatter`` one under the key
        of the others (:meth:`request_part`: off root ``x`` is not read), and
        ``barrier``, whose request holds no caller memory, reuses the request
        of its first call.
    """

    __slots__ = ("_empty", "_flat", "_fresh", "_head", "_nothing", "_reads_x", "_tail", "go")

    def __init__(
        self,
        req: Request,
        shape: tuple[int, ...],
        has_out: bool,
        flat: bool = False,
        go: Callable[[Request, int], Any] | None = None,
    ) -> None:
        #: The call runner's frame that runs these calls whole while it is plain
        #: (``CallRunner.short_path``), or None.
        self.go = go
        self._head = (req.spec, req.ctx, req.op)
        self._tail = (req.average, req.plan)
        # Where the call writes no output here (a rooted call off root): an empty OUT.
        self._empty = None if has_out else req.out
        self._fresh = shape  # the shape of a new result array
        self._nothing = empty_of(req.out.dtype)  # IN of a call that fills its x (request_fill)
        # x is one-dimensional (its shape is in the key): it is its own flat view
        self._flat = flat
        self._reads_x = req.inp.size > 0  # not a scatter's off root (request_part)

    def request(self, x: np.ndarray, in_place: bool) -> Request:
        """The request of this call on ``x`` (``in_place``: ``out=x``)."""
        flat = x if self._flat else x.ravel()
        spec, ctx, op = self._head
        average, plan = self._tail
        if in_place:
            return _new(
                Request, (spec, ctx, op, flat, flat, None, x, True, average, plan, True, None)
            )
        if self._empty is not None:
            out = self._empty
            return _new(
                Request,
                (spec, ctx, op, flat, out, None, None, plan.fills_x, average, plan, False, None),
            )
        new = np.empty(self._fresh, x.dtype)
        fresh = new.ravel()
        return _new(
            Request,
            (spec, ctx, op, flat, fresh, None, new, plan.fills_x, average, plan, False, None),
        )

    def request_fill(self, x: np.ndarray) -> Request:
        """The request of a call that fills ``x`` in place (broadcast: root sends from it)."""
        spec, ctx, op = self._head
        average, plan = self._tail
        flat = x if self._flat else x.ravel()
        return _new(
            Request,
            (spec, ctx, op, self._nothing, flat, None, x, True, average, plan, False, None),
        )

    def request_part(self, x: np.ndarray, out: np.ndarray | None) -> Request:
        """A scatter's request: root's ``x`` is read, another rank's is not; into ``out``
        (contiguous, writable, apart from x), or a new array where it is None."""
        spec, ctx, op = self._head
        average, plan = self._tail
        inp = (x if self._flat else x.ravel()) if self._reads_x else self._nothing
        if out is None:
            new = np.empty(self._fresh, x.dtype)
            fresh = new.ravel()
            return _new(
                Request, (spec, ctx, op, inp, fresh, None, new, False, average, plan, False, None)
            )
        into = out if out.ndim == 1 else out.ravel()
        return _new(
            Request, (spec, ctx, op, inp, into, None, out, True, average, plan, False, None)
        )

    def request_into(self, x: np.ndarray, out: np.ndarray) -> Request:
        """The request of this call on ``x`` into ``out``: contiguous, writable, apart from x."""
        if self._empty is not None:  # no result here: out is not written, as the long way
            return self.request(x, False)
        spec, ctx, op = self._head
        average, plan = self._tail
        flat = x if self._flat else x.ravel()
        into = out if out.ndim == 1 else out.ravel()
        return _new(
            Request, (spec, ctx, op, flat, into, None, out, True, average, plan, False, None)
        )


def separate(x: np.ndarray, out: np.ndarray) -> bool:
    """Whether ``x`` and ``out`` share no memory (the short path's test; a few tens of ns).

    Two arrays that own their memory are apart unless they are one array, and so are
    views of two different such arrays (``out=grid`` with ``grid = buf.reshape(p, n)``);
    other views are tested by their bounds (``np.may_share_memory``, about 0.25 µs).
    """
    xf, of = x.flags, out.flags
    if xf.owndata and of.owndata:
        return x is not out
    xb = x if xf.owndata else x.base
    ob = out if of.owndata else out.base
    if (
        xb is not ob
        and type(xb) is np.ndarray
        and type(ob) is np.ndarray
        and xb.flags.owndata
        and ob.flags.owndata
    ):
        return True
    return not np.may_share_memory(x, out)
