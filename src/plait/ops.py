"""Reduction ops and the dtypes plait moves.

An :class:`Op` wraps a binary numpy ufunc with its traits: whether it is
commutative (non-commutative ops are reduced in rank order, which restricts
the algorithms that may run them) and which dtype kinds it makes sense for.
The built-in ops are ``SUM, PROD, MIN, MAX, AVG, BAND, BOR, BXOR``; users make
their own from any binary ufunc::

    logsumexp = plait.Op(np.logaddexp, commutative=True)

Supported dtypes: bool, every integer width, float16/32/64 and longdouble,
complex64/128 (and clongdouble), and bfloat16 when the optional ``ml_dtypes``
package is installed.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

import numpy as np

__all__ = [
    "AVG",
    "BAND",
    "BOR",
    "BXOR",
    "MAX",
    "MIN",
    "PROD",
    "SUM",
    "Op",
    "check_dtype",
    "fold",
    "fold_one",
]

_INT = "iu"
_BOOL = "b"
_REAL = "f"
_CPLX = "c"


def _is_ml_float(dtype: np.dtype) -> bool:
    # ml_dtypes registers most of its floats (bfloat16, float8_*) with kind 'V'.
    module = dtype.type.__module__
    return dtype.kind == "V" and dtype.names is None and module.startswith("ml_dtypes")


def dtype_family(dtype: np.dtype) -> str:
    """'bool', 'int', 'float' or 'complex'; 'unsupported' for anything else.

    Kinds 'f' and 'c' count only for numpy's own types (``isbuiltin`` 2 is a type another
    package registered): ml_dtypes gives some of its types those kinds too (complex32,
    float8_e5m2), and complex32's ``.real`` is not a float view, so PROD, which multiplies
    complex numbers through their real and imaginary parts, failed midway on it."""
    kind = dtype.kind
    if kind == "b":
        return "bool"
    if kind in _INT:
        return "int"
    if dtype.isbuiltin == 2:  # another package's type: of these, bfloat16 alone
        return "float" if _is_ml_float(dtype) and dtype.name == "bfloat16" else "unsupported"
    if kind == "f":
        return "float"
    if kind == "c":
        return "complex"
    return "unsupported"


def check_dtype(dtype: np.dtype) -> None:
    """TypeError unless plait can move and reduce ``dtype``."""
    if dtype_family(dtype) == "unsupported":
        raise TypeError(
            f"dtype {dtype} is not supported; expected bool, an integer, float16/32/64, "
            "longdouble, complex64/128, or bfloat16 (with the ml_dtypes extra)"
        )


class Op:
    """A reduction op: a binary numpy ufunc plus its traits.

    Args:
        ufunc: a binary ufunc such as ``np.add`` or ``np.logaddexp``; it is called
            as ``ufunc(a, b, out=a_or_b)`` on equal-length 1-D arrays. Any function
            with that signature and ufunc semantics (element-wise, associative,
            safe when ``out`` is one of the inputs) is accepted too.
        commutative: whether ``a ∘ b == b ∘ a``. A non-commutative op gives
            ``x0 ∘ x1 ∘ … ∘ x(p-1)`` in rank order and runs only on algorithms
            that keep that order.
        name: shown in messages; defaults to the ufunc's name.
        families: dtype families it makes sense for (``"bool"``, ``"int"``,
            ``"float"``, ``"complex"``); None means whatever the ufunc accepts.
    """

    __slots__ = ("_families", "_key", "average", "commutative", "name", "ufunc")

    def __init__(
        self,
        ufunc: Any,
        *,
        commutative: bool = True,
        name: str | None = None,
        families: tuple[str, ...] | None = None,
        _average: bool = False,
    ) -> None:
        if not callable(ufunc):
            raise TypeError(f"Op needs a numpy ufunc such as np.add; got {type(ufunc).__name__}")
        if isinstance(ufunc, np.ufunc) and (ufunc.nin != 2 or ufunc.nout != 1):
            raise ValueError(
                f"Op needs a binary ufunc (2 inputs, 1 output); {ufunc.__name__} has "
                f"{ufunc.nin} inputs and {ufunc.nout} outputs"
            )
        self.ufunc = ufunc
        self.commutative = bool(commutative)
        default_name: str = getattr(ufunc, "__name__", type(ufunc).__name__)
        self.name = name or default_name
        self._families = families
        self.average = _average
        self._key = f"{self.name}:{int(self.commutative)}:{_identity(ufunc)}"

    def __repr__(self) -> str:
        return f"plait.{self.name}" if self.name.isupper() else f"plait.Op({self.name})"

    @property
    def key(self) -> str:
        """A string identifying the op across processes (for mismatch checks): its name,
        whether it commutes, and what its function is (Note [an op's identity])."""
        return self._key

    def kernel(self, dtype: np.dtype) -> Any:
        """The function that reduces arrays of ``dtype``: the ufunc, but for a product of
        complex numbers (Note [complex products])."""
        if self.ufunc is np.multiply and dtype.kind == "c":
            return complex_multiply
        return self.ufunc

    def check(self, dtype: np.dtype) -> None:
        """TypeError if this op makes no sense for ``dtype``."""
        check_dtype(dtype)
        family = dtype_family(dtype)
        if self._families is not None:
            if family not in self._families:
                raise TypeError(
                    f"op {self.name} is not defined for {dtype} ({family}); it needs "
                    + " or ".join(self._families)
                    + " data"
                )
            return
        _probe(self.ufunc, dtype)


# Note [complex products]
#     numpy's complex multiply gives other bits (the last one) by the path it takes: with
#     numpy 2.4 on this kind of CPU, one element with ``out`` one of the inputs runs a scalar
#     loop, and any other call a vector loop that rounds once less. So ranks that fold the
#     same operands in the same order got different bits where one wrote in place and
#     another did not (a one-shot fold of one element, the last piece of a vector cut into
#     pieces), and a result could differ with the piece it fell in. Every reduction of
#     complex numbers by PROD (and the reference the tests compare with) calls
#     complex_multiply instead: the textbook formula in four real products, a difference
#     and a sum, each one rounding of numpy's, whatever the length, aliasing or alignment.

#
# Note [one-element folds]
#     numpy's loop for one element gives the NaN of the operand that ``out`` is not, where
#     every other loop (and one element written to fresh memory) gives one fixed
#     operand's: with numpy 2.4 here, ``np.add(a, b, out=a)`` of one float32, float64 or
#     complex element returns ``b``'s NaN, ``out=b`` and a fresh ``out`` return ``a``'s
#     (fmin and complex products alike; a NaN's sign and payload are its bits). Ranks
#     that fold the same operands in the same order into their own buffers, each its own
#     (recursive doubling's partners; a one-shot fold in place), got different bits from
#     a one-element allreduce whose ranks held NaNs of different signs (``inf - inf``
#     against ``np.nan``). So every fold of one element into one of its operands computes
#     into fresh memory and copies the result (:func:`fold_one`): the bits then depend on
#     the operands and their order alone.


def fold(ufunc: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``ufunc(a, b, out=out)``, ``out`` being ``a`` or ``b``, with bits that depend on the
    operands and their order alone (Note [one-element folds])."""
    if out.size == 1:
        fold_one(ufunc, a, b, out)
    else:
        ufunc(a, b, out=out)


def fold_one(ufunc: Any, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``ufunc(a, b, out=out)`` for one element, through fresh memory, so that the bits do
    not depend on which operand ``out`` is (Note [one-element folds])."""
    fresh = np.empty_like(out)
    ufunc(a, b, out=fresh)
    out[...] = fresh


#: Elements of a complex product computed at a time (its temporaries stay in cache).
_COMPLEX_CHUNK = 8192


def complex_multiply(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``a * b`` for 1-D complex arrays of one length, with the same bits on every path
    (Note [complex products]); ``out`` may be ``a`` or ``b``. About 4 times numpy's time
    for large arrays, 10 for a few elements."""
    if out is None:
        out = np.empty(a.shape, np.result_type(a, b))
    n = a.shape[0]
    if n == 0:
        return out
    step = min(n, _COMPLEX_CHUNK)
    re, im, t = (np.empty(step, out.real.dtype) for _ in range(3))
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        x, y, z = re[: hi - lo], im[: hi - lo], t[: hi - lo]
        ar, ai, br, bi = a.real[lo:hi], a.imag[lo:hi], b.real[lo:hi], b.imag[lo:hi]
        np.multiply(ar, br, out=x)
        np.multiply(ai, bi, out=z)
        np.subtract(x, z, out=x)
        np.multiply(ar, bi, out=y)
        np.multiply(ai, br, out=z)
        np.add(y, z, out=y)
        out.real[lo:hi] = x  # after every read of a[lo:hi] and b[lo:hi]: out may be either
        out.imag[lo:hi] = y
    return out


def _identity(f: Any) -> str:
    """What ``f`` is, in words equal in every process that runs the same code.

    Note [an op's identity]
    ~~~~~~~~~~~~~~~~~~~~~~~
    Ranks whose ops differ must fail with MismatchError, not return different sums. An op's
    name is not enough: every lambda is ``<lambda>``, and ``name=`` may give two functions
    one name. So the key also holds a ufunc's own name, or a function's module, qualified
    name and a checksum of its bytecode, the names it looks up and its plain constants
    (``np.add`` against ``np.multiply`` in one lambda, ``a + b`` against ``a * b``): equal
    in every process of one job, which runs one script on one Python. What a closure holds
    or a ``functools.partial`` binds is not compared.
    """
    if isinstance(f, np.ufunc):
        return f"numpy.{f.__name__}"
    kind = f if hasattr(f, "__qualname__") else type(f)
    where = f"{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', '?')}"
    code = getattr(f, "__code__", None)
    if code is None:
        return where
    plain = tuple(c for c in code.co_consts if isinstance(c, int | float | complex | str | bytes))
    text = repr((code.co_names, code.co_varnames, plain)).encode()
    return f"{where}:{zlib.crc32(code.co_code):08x}{zlib.crc32(text):08x}"


@functools.lru_cache(maxsize=256)
def _probe(ufunc: Any, dtype: np.dtype) -> None:
    a = np.zeros(1, dtype)
    b = np.zeros(1, dtype)
    try:
        with np.errstate(all="ignore"):
            ufunc(a, b, out=a)
    except (TypeError, ValueError) as exc:
        name = getattr(ufunc, "__name__", "op")
        raise TypeError(f"op {name} does not support dtype {dtype}: {exc}") from None


_ALL = ("bool", "int", "float", "complex")
_ORDERED = ("bool", "int", "float")
_BITS = ("bool", "int")

SUM = Op(np.add, name="SUM", families=_ALL)
PROD = Op(np.multiply, name="PROD", families=_ALL)
MIN = Op(np.minimum, name="MIN", families=_ORDERED)
MAX = Op(np.maximum, name="MAX", families=_ORDERED)
#: The mean over ranks: a SUM, then a division by the number of ranks.
AVG = Op(np.add, name="AVG", families=("float", "complex"), _average=True)
BAND = Op(np.bitwise_and, name="BAND", families=_BITS)
BOR = Op(np.bitwise_or, name="BOR", families=_BITS)
BXOR = Op(np.bitwise_xor, name="BXOR", families=_BITS)
