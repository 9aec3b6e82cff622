"""Rotary position embedding (RoPE) in the Llama convention.

Each head vector ``x`` of size ``D`` is split into halves ``x1 = x[:D/2]``, ``x2 = x[D/2:]``; at
position ``m`` the pair ``(x1[i], x2[i])`` is rotated by the angle ``m * base**(-2i/D)``::

    rope(x, m) = concat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)

which is Hugging Face's ``LlamaRotaryEmbedding`` with ``rotate_half``, the order in which the
``q_proj``/``k_proj`` weights of Llama, Mistral and Falcon checkpoints are stored there.  Because the
rotation is orthogonal, its gradient is the inverse rotation (``inverse=True``).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .. import _arrays
from ._checks import positive_int


class RotaryEmbedding:
    """Rotary position embedding for heads of size ``head_dim`` (Llama convention).

    Parameters
    ----------
    head_dim : int
        Size of each head, even.
    base : float
        The frequency base (``rope_theta``): 10000 for Llama 2 and Mistral, 500000 for Llama 3.

    Attributes
    ----------
    head_dim : int
    base : float
    inv_freq : numpy.ndarray, float64 (head_dim // 2,)
        ``base ** (-2i / head_dim)``, the rotation speed of pair i.
    """

    head_dim: int
    base: float
    inv_freq: np.ndarray

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        self.head_dim = positive_int("head_dim", head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim: expected an even size for rotary embedding, received {head_dim}")
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 1:
            raise ValueError(f"base: expected a number > 1, received {base!r}")
        self.base = float(base)
        self.inv_freq = self.base ** (-np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim)

    def __repr__(self) -> str:
        return f"RotaryEmbedding(head_dim={self.head_dim}, base={self.base:g})"

    def apply(self, x: Any, positions: Any, *, inverse: bool = False) -> Any:
        """Rotate every head vector of ``x`` by its position.

        Parameters
        ----------
        x : numpy or CuPy array, (..., S, H, D)
            Heads in ``"bshd"`` order (e.g. ``(B, S, H, D)``), any float dtype; not modified.
        positions : int array, broadcastable to ``x.shape[:-2]`` (e.g. ``(B, S)`` or ``(S,)``)
            The position of each token (host or ``x``'s device).
        inverse : bool
            Rotate by minus the angle: undoes :meth:`apply`, and is its gradient.

        Returns
        -------
        array, x's shape and dtype
            A new array; arithmetic in float32 for half inputs, float64 for float64.
        """
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x: expected a last axis of head_dim={self.head_dim}, received shape {tuple(x.shape)}"
            )
        xp = _arrays.namespace(x)
        compute = _arrays.accumulation_dtype(_arrays.dtype_name(x.dtype))
        angles = xp.asarray(positions, dtype=np.float64)[..., None] * xp.asarray(self.inv_freq)
        cos = xp.cos(angles).astype(compute)[..., None, :]
        sin = xp.sin(angles).astype(compute)[..., None, :]
        if inverse:
            sin = -sin
        half = self.head_dim // 2
        values = x.astype(compute, copy=False)
        first, second = values[..., :half], values[..., half:]
        rotated = xp.empty(x.shape, dtype=compute)
        rotated[..., :half] = first * cos - second * sin
        rotated[..., half:] = second * cos + first * sin
        return rotated.astype(x.dtype, copy=False)
