"""fastattn: fused ("flash") scaled-dot-product attention for numpy, CuPy and PyTorch.

>>> import numpy as np, fastattn
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 8, 16), dtype=np.float32)
>>> fastattn.attention(q, k, v, causal=True).shape
(1, 2, 8, 16)
"""

from __future__ import annotations

from . import backends, nn
from ._threads import get_num_threads, set_num_threads
from .backends.registry import UnsupportedError, use_backend
from .functional import attention, attention_backward, explain, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "UnsupportedError",
    "__version__",
    "attention",
    "attention_backward",
    "backends",
    "explain",
    "get_num_threads",
    "nn",
    "scaled_dot_product_attention",
    "set_num_threads",
    "use_backend",
]
