"""The immutable description of one attention call that backends are asked about.

``functional.py`` validates a call once and builds an :class:`AttentionProblem`; the registry hands
it to each backend's ``not_supported_reasons`` and then to the chosen backend's ``forward`` or
``backward`` together with the arrays (numpy or CuPy, in ``(B, H, S, D)`` order: a view of the
caller's memory whatever the layout) and the :class:`AttentionExtras`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from ._dropout import Dropout

Direction = Literal["forward", "backward"]
Causal = Literal["top_left", "bottom_right"]
MaskKind = Literal["bool", "float"]
Layout = Literal["bhsd", "bshd"]


@dataclass(frozen=True)
class AttentionProblem:
    """Shapes, dtypes, strides and flags of one validated attention call.

    Attributes
    ----------
    direction : {"forward", "backward"}
        Which pass the backend is asked to run.
    framework, device : str
        The caller's framework (``"numpy"``, ``"torch"``, ...) and ``"cpu"`` or ``"cuda"``.
    dtype : str
        Input dtype name: ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"float64"``.
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim, head_dim_v : int
        ``B, Hq, Hkv, Sq, Sk, D, Dv``.
    layout : {"bhsd", "bshd"}
        The caller's layout; results are allocated contiguous in it.
    scale : float
        Multiplier of ``q @ k.T`` (``1/sqrt(D)`` unless given).
    causal : {None, "top_left", "bottom_right"}
        Causal alignment, or None.
    window : tuple of two ints or None
        ``(left, right)`` sliding window, -1 meaning unbounded on that side.
    softcap : float or None
        Scores become ``softcap * tanh(scores / softcap)`` before masking.
    mask : {None, "bool", "float"}
        Kind of the ``mask`` argument.
    mask_shape : tuple of four ints or None
        The mask's shape, left-padded with 1s to four axes; each axis is 1 or the full size.
    mask_dtype : str or None
        The mask's dtype name (``"bool"``, ``"float32"``, ...).
    has_key_lengths : bool
        Whether ``key_lengths`` was given.
    q_strides, k_strides, v_strides : tuple of four ints
        Element strides of q, k, v in ``(B, H, S, D)`` order (last one 1 unless that axis is 1).
    deterministic : bool
        Backward only: gradients must be bit-identical from run to run (no floating-point atomics
        whose order varies).  Backends that are always deterministic ignore it.
    dropout_p : float
        Attention-dropout probability, 0 for none (the seed and offset are in the extras).
    key_offset : int
        Where the queries sit among the keys, for causal and window: query i sits at key position
        ``i + key_offset`` (``Sk - Sq`` under bottom-right alignment, else 0, for a whole call; any
        integer for one block of a sequence split across ranks, ``fastattn.distributed``).
    """

    direction: Direction
    framework: str
    device: str
    dtype: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    head_dim_v: int
    layout: Layout
    scale: float
    causal: Causal | None
    window: tuple[int, int] | None
    softcap: float | None
    mask: MaskKind | None
    mask_shape: tuple[int, int, int, int] | None
    mask_dtype: str | None
    has_key_lengths: bool
    q_strides: tuple[int, int, int, int]
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    deterministic: bool = False
    dropout_p: float = 0.0
    key_offset: int = 0

    def __hash__(self) -> int:
        # Problems key the caches of the registry and the backends, and a repeated call reuses the
        # same problem object: its hash is computed once.
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, field.name) for field in dataclasses.fields(self)))

    @property
    def group_size(self) -> int:
        """Query heads per kv head, ``Hq // Hkv``."""
        return self.heads_q // self.heads_kv

    @functools.cached_property
    def is_empty(self) -> bool:
        """No work: B, Sq or Sk is 0 (out is then all 0 with lse -inf, and the gradients are 0).

        Read on every call, so kept once computed (the problem is immutable)."""
        return self.batch == 0 or self.seq_q == 0 or self.seq_k == 0

    def describe(self) -> str:
        """Return a one-line summary, e.g. for ``explain``."""
        features = [
            f"{self.direction} {self.dtype} on {self.framework} ({self.device})",
            f"B={self.batch} Hq={self.heads_q} Hkv={self.heads_kv} Sq={self.seq_q} "
            f"Sk={self.seq_k} D={self.head_dim} Dv={self.head_dim_v} layout={self.layout}",
        ]
        if self.causal:
            features.append(f"causal={self.causal}")
        if self.window:
            features.append(f"window={self.window}")
        if self.mask:
            features.append(f"{self.mask} mask {self.mask_shape}")
        if self.has_key_lengths:
            features.append("key_lengths")
        if self.softcap is not None:
            features.append(f"softcap={self.softcap:g}")
        if self.deterministic:
            features.append("deterministic")
        return ", ".join(features)


class AttentionExtras(NamedTuple):
    """The optional arrays of a call, as native (numpy or CuPy) arrays on the inputs' device.

    Attributes
    ----------
    mask : array or None
        The caller's mask viewed with four axes (leading size-1 axes added; never expanded).
    key_lengths : array or None
        int64 ``(B,)`` valid key counts.
    dropout : Dropout or None
        Probability, seed and offset of attention dropout (``fastattn/_dropout.py``), or None.
    """

    mask: Any = None
    key_lengths: Any = None
    dropout: Dropout | None = None
