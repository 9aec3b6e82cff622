"""Attention dropout: the Philox4x32-10 keep mask shared by every backend, and its arguments.

The mask is never stored.  Each backend regenerates the decision for score element (b, h, i, j)
from (seed, offset, b, h, i, j) with the counter layout of ``fastattn/_shared/philox.h``, so the
forward and the backward agree, and the CPU kernels, the reference (numpy or CuPy, here) and the
GPU kernels produce identical masks for the same seed.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = 0xFFFFFFFF


@dataclass(frozen=True)
class Dropout:
    """A validated dropout request.

    Attributes
    ----------
    p : float
        Probability of dropping each attention probability, in (0, 1].
    seed : int
        Philox key, in [0, 2**64).
    offset : int
        Philox counter word 3, in [0, 2**32): a different offset gives an independent mask under
        the same seed (one per training step, say).
    """

    p: float
    seed: int
    offset: int

    @property
    def threshold(self) -> int:
        """A 32-bit word at or above this keeps its element: ``floor(p * 2**32)`` (2**32 for p = 1)."""
        return int(self.p * 2.0**32)

    @property
    def key(self) -> tuple[int, int]:
        return self.seed & _LOW, self.seed >> 32


def probability(dropout_p: Any) -> float:
    """Validate ``dropout_p``: a real number in [0, 1] (0 = no dropout)."""
    if type(dropout_p) is float and 0.0 <= dropout_p <= 1.0:
        return dropout_p
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1], received {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], received {dropout_p!r}")
    return p


def request(p: float, seed: Any, offset: Any, *, need_seed: bool) -> Dropout | None:
    """Validate ``dropout_seed`` and ``dropout_offset`` for a checked probability; None when p is 0.

    Parameters
    ----------
    p : float
        As returned by :func:`probability`.
    need_seed : bool
        True for the backward, which must regenerate the forward's mask: a missing seed is then an
        error.  The forward draws a fresh seed when none is given.
    """
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"dropout_seed: expected an int in [0, 2**64) or None, received {seed!r}")
    if seed is not None and not 0 <= int(seed) < 2**64:
        raise ValueError(f"dropout_seed: expected an int in [0, 2**64) or None, received {seed!r}")
    if type(offset) is not int and (isinstance(offset, bool) or not isinstance(offset, numbers.Integral)):
        raise TypeError(f"dropout_offset: expected an int in [0, 2**32), received {offset!r}")
    if not 0 <= int(offset) < 2**32:
        raise ValueError(f"dropout_offset: expected an int in [0, 2**32), received {offset!r}")
    if p == 0.0:
        return None
    if seed is None:
        if need_seed:
            raise ValueError(
                "dropout_seed: expected the seed the forward used (the backward regenerates its "
                f"dropout mask), received None with dropout_p={p}"
            )
        seed = int(np.random.default_rng().integers(0, 2**64, dtype=np.uint64))
    return Dropout(p, int(seed), int(offset))


def philox4x32_10(xp: ModuleType, counter: tuple[Any, Any, Any, Any], key: tuple[int, int]) -> list[Any]:
    """Philox4x32-10 on arrays of counter words (uint64 arrays holding 32-bit values)."""
    c0, c1, c2, c3 = (xp.asarray(word, dtype=xp.uint64) for word in counter)
    k0, k1 = xp.uint64(key[0]), xp.uint64(key[1])
    low = xp.uint64(_LOW)
    for round_index in range(10):
        if round_index:
            k0 = (k0 + xp.uint64(_W0)) & low
            k1 = (k1 + xp.uint64(_W1)) & low
        p0 = xp.uint64(_M0) * c0
        p1 = xp.uint64(_M1) * c2
        c0, c1, c2, c3 = (p1 >> xp.uint64(32)) ^ c1 ^ k0, p1 & low, (p0 >> xp.uint64(32)) ^ c3 ^ k1, p0 & low
    return [c0, c1, c2, c3]


def factors(xp: ModuleType, dropout: Dropout, shape: tuple[int, int, int, int], dtype: Any) -> Any:
    """The mask as multipliers: ``1 / (1 - p)`` where kept, 0 where dropped.

    Parameters
    ----------
    shape : (B, Hq, Sq, Sk)
    dtype : the compute dtype (float32, or float64 for float64 inputs)

    Returns
    -------
    array of ``shape`` and ``dtype``
    """
    batch, heads, rows, cols = shape
    blocks = (cols + 3) // 4
    head_row = (xp.arange(batch, dtype=xp.uint64)[:, None] * heads + xp.arange(heads, dtype=xp.uint64))
    counter = (
        xp.arange(blocks, dtype=xp.uint64)[None, None, None, :],
        xp.arange(rows, dtype=xp.uint64)[None, None, :, None],
        head_row[:, :, None, None],
        xp.full((1, 1, 1, 1), dropout.offset, dtype=xp.uint64),
    )
    counter = tuple(xp.broadcast_to(word, (batch, heads, rows, blocks)) for word in counter)
    words = xp.stack(philox4x32_10(xp, counter, dropout.key), axis=-1).reshape(batch, heads, rows, 4 * blocks)
    keep = words[..., :cols] >= xp.uint64(dropout.threshold)
    scale = np.dtype(dtype).type(keep_scale(dropout.p))
    return xp.where(keep, scale, np.dtype(dtype).type(0))


def keep_scale(p: float) -> float:
    """The multiplier of a kept probability, ``1 / (1 - p)`` (0 for p = 1, where nothing is kept)."""
    return 0.0 if p == 1.0 else 1.0 / (1.0 - p)
