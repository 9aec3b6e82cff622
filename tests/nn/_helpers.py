"""Shared helpers of the layer tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastattn.nn import MultiheadAttention


def random_layer(rng: np.random.Generator, *args: Any, **kwargs: Any) -> MultiheadAttention:
    """A float64 (by default) layer with random non-zero biases, so that biases are exercised."""
    kwargs.setdefault("dtype", np.float64)
    layer = MultiheadAttention(*args, seed=rng, **kwargs)
    for name, param in layer.named_parameters():
        if name.endswith(".bias"):
            param[...] = rng.standard_normal(param.shape) * 0.5
    return layer


def params_of(layer: MultiheadAttention) -> dict[str, np.ndarray]:
    """float64 copies of a layer's parameters, by name."""
    return {name: np.array(param, dtype=np.float64) for name, param in layer.named_parameters()}


def max_error(actual: Any, expected: Any) -> float:
    """Largest absolute difference (any framework, via numpy)."""
    return float(np.max(np.abs(np.asarray(actual, dtype=np.float64) - np.asarray(expected, dtype=np.float64))))
