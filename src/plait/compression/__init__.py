"""Gradient compression for ``comm.allreduce(x, compression=...)``.

::

    import plait
    from plait.compression import FP16, BF16, Int8, TopK, PowerSGD

    g = comm.allreduce(grad, plait.AVG, compression=Int8())              # stateless
    g = comm.allreduce(w.grad, plait.AVG, compression=topk.with_key("w"))  # state per name

Every compressor works on float16/32/64 numpy arrays, takes ``SUM`` or
``AVG``, exchanges its bytes with the communicator's own collectives and
returns the same bits on every rank:

=================  ====================================  =========================================
compressor         exchange                              bytes sent vs a float32 ring allreduce
=================  ====================================  =========================================
:class:`FP16`      allreduce of float16                  1/2
:class:`BF16`      allreduce of bfloat16 bit patterns    1/2 (no ml_dtypes needed)
:class:`Int8`      alltoall + allgather of int8 blocks   1/4 + 1/block_size (the scales)
:class:`TopK`      allgather of (index, value) pairs     size * k/count * (4 + 4) / 8
:class:`PowerSGD`  two allreduces of thin matrices       (n + m) r / (n m)
=================  ====================================  =========================================

Stateful compressors (error feedback, PowerSGD's Q) keep their state per
tensor, keyed by a name (``c.with_key(name)``) or by the identity of the
array passed; see Note [compressor state] in :mod:`plait.compression.base`.
docs/compression.md has each method's formula and measured effect.
"""

from plait.compression.base import Compressor as Compressor
from plait.compression.base import Keyed as Keyed
from plait.compression.cast import BF16 as BF16
from plait.compression.cast import FP16 as FP16
from plait.compression.int8 import Int8 as Int8
from plait.compression.powersgd import PowerSGD as PowerSGD
from plait.compression.topk import TopK as TopK

__all__ = ["BF16", "FP16", "Compressor", "Int8", "Keyed", "PowerSGD", "TopK"]
