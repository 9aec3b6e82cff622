"""Argument checks shared by the layers.

Every check raises ``TypeError`` (wrong kind of thing) or ``ValueError`` (right kind, wrong value)
with a message that starts with the argument's name and says what was expected and what was
received, as the rest of fastattn does.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from .. import _arrays

DEVICES: tuple[str, ...] = ("cpu", "cuda")


def positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise unless it is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a positive int, received {_arrays.describe_value(value)}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive size, received {value}")
    return int(value)


def head_counts(embed_dim: Any, num_heads: Any, num_kv_heads: Any) -> tuple[int, int, int]:
    """Validate an attention layer's sizes and return ``(embed_dim, num_heads, num_kv_heads)``.

    ``num_kv_heads=None`` means as many kv heads as query heads (multi-head attention).  Raises a
    ValueError naming the numbers when ``embed_dim`` is not a multiple of ``num_heads``, when
    ``num_kv_heads`` exceeds ``num_heads``, or when it does not divide it.
    """
    embed_dim = positive_int("embed_dim", embed_dim)
    num_heads = positive_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if embed_dim % num_heads:
        raise ValueError(
            f"embed_dim: expected a multiple of num_heads={num_heads}, received {embed_dim} "
            f"({embed_dim} % {num_heads} = {embed_dim % num_heads})"
        )
    if num_kv_heads > num_heads:
        raise ValueError(
            f"num_kv_heads: expected at most num_heads={num_heads}, received {num_kv_heads}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_kv_heads: expected a divisor of num_heads={num_heads}, received {num_kv_heads} "
            f"({num_heads} % {num_kv_heads} = {num_heads % num_kv_heads})"
        )
    return embed_dim, num_heads, num_kv_heads


def float_dtype(name: str, dtype: Any) -> np.dtype:
    """Return the numpy dtype for ``dtype`` if it is float16, bfloat16, float32 or float64."""
    if isinstance(dtype, str) and dtype in _arrays.SUPPORTED_DTYPES:
        return _arrays.numpy_dtype(dtype)
    try:
        resolved = np.dtype(dtype)
    except TypeError as error:
        raise TypeError(
            f"{name}: expected one of {', '.join(_arrays.SUPPORTED_DTYPES)}, received {dtype!r}"
        ) from error
    if resolved.name not in _arrays.SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: expected one of {', '.join(_arrays.SUPPORTED_DTYPES)}, received {resolved.name}"
        )
    return resolved


def device_name(name: str, device: Any) -> str:
    """Return ``device`` if it is ``"cpu"`` or ``"cuda"``."""
    if not isinstance(device, str) or device not in DEVICES:
        raise ValueError(f"{name}: expected 'cpu' or 'cuda', received {device!r}")
    return device


def flag(name: str, value: Any) -> bool:
    """Return ``value`` if it is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, received {_arrays.describe_value(value)}")
    return value


def window(value: Any) -> tuple[int, int] | None:
    """Normalise a layer's ``window``: None, an int ``w`` (meaning ``(w, w)``) or ``(left, right)``.

    Sides are ``>= 0`` or ``-1`` for unbounded, as in :func:`fastattn.attention`.
    """
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"window: expected an int >= 0 or a pair (left, right), received {value}")
        return int(value), int(value)
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(side, numbers.Integral) and not isinstance(side, bool) for side in value)
    ):
        left, right = int(value[0]), int(value[1])
        if left < -1 or right < -1:
            raise ValueError(
                f"window: expected sides >= 0, or -1 for unbounded, received ({left}, {right})"
            )
        return left, right
    raise TypeError(
        f"window: expected None, an int >= 0 or a pair of ints (left, right), received {value!r}"
    )
