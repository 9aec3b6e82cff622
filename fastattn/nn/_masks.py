"""From a layer's masking arguments to the options of :func:`fastattn.attention`.

Two translations live here:

* torch.nn.MultiheadAttention's ``attn_mask`` and ``key_padding_mask`` (bool: True = NOT allowed;
  float: added) to fastattn's ``mask`` (bool: True = may attend; float: added) and ``key_lengths``.
  A bool padding mask whose padding sits at the end of every row becomes ``key_lengths``, which
  needs no mask array at all and lets kernels skip padded tiles.
* A KV-cache step (per-row start positions and lengths) to bottom-right causal alignment plus
  ``key_lengths``, or, only where rows are misaligned and that cannot express it, an exact bool mask.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .. import _arrays
from .._options import AttentionOptions


def _allowed_bool_or_float(name: str, native: Any) -> tuple[Any, bool]:
    """Return (array in fastattn's convention, is_bool) for a torch-convention mask."""
    if native.dtype == np.bool_:
        return ~native, True
    if _arrays.dtype_name(native.dtype) not in _arrays.SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: expected a bool array (True = ignore, torch's convention) or a float array "
            f"(added to the scores), received dtype {_arrays.dtype_name(native.dtype)}"
        )
    return native, False


def _as_float(xp: ModuleType, allowed: Any, dtype: Any) -> Any:
    """A bool 'may attend' array as an additive float mask (0 or -inf)."""
    return xp.where(allowed, 0.0, -np.inf).astype(dtype)


def right_padding_lengths(xp: ModuleType, valid: Any) -> Any:
    """``valid.sum(-1)`` if every row of the bool (B, S) ``valid`` is True then False, else None."""
    if valid.shape[1] > 1 and bool(xp.any(valid[:, 1:] & ~valid[:, :-1])):
        return None
    return valid.sum(axis=1).astype(np.int64)


def torch_masks(
    xp: ModuleType,
    attn_mask: Any,
    key_padding_mask: Any,
    *,
    batch: int,
    num_heads: int,
    seq_q: int,
    seq_k: int,
) -> tuple[Any, Any]:
    """Translate torch.nn.MultiheadAttention's masks into fastattn's ``(mask, key_lengths)``.

    Parameters
    ----------
    xp : module
        numpy or cupy.
    attn_mask : native array or None
        ``(Sq, Sk)`` or ``(batch * num_heads, Sq, Sk)``; bool True = not allowed, or float added.
    key_padding_mask : native array or None
        ``(batch, Sk)``; bool True = ignore this key, or float added.
    batch, num_heads, seq_q, seq_k : int
        The call's sizes (batch 1 for unbatched inputs, whose padding mask gets a batch axis first).

    Returns
    -------
    mask : array or None
        fastattn convention, ``(1|B, 1|H, Sq|1, Sk)``.
    key_lengths : int array (B,) or None
        When the padding mask is bool right padding.
    """
    padding, lengths = None, None
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, seq_k):
            raise ValueError(
                f"key_padding_mask: expected shape ({batch}, {seq_k}) (batch, key sequence), "
                f"received {tuple(key_padding_mask.shape)}"
            )
        allowed, is_bool = _allowed_bool_or_float("key_padding_mask", key_padding_mask)
        lengths = right_padding_lengths(xp, allowed) if is_bool else None
        padding = None if lengths is not None else allowed[:, None, None, :]
    structure = None
    if attn_mask is not None:
        shape = tuple(attn_mask.shape)
        if shape == (seq_q, seq_k):
            view = attn_mask[None, None]
        elif shape == (batch * num_heads, seq_q, seq_k):
            view = attn_mask.reshape(batch, num_heads, seq_q, seq_k)
        else:
            raise ValueError(
                f"attn_mask: expected shape ({seq_q}, {seq_k}) or ({batch * num_heads}, {seq_q}, {seq_k}) "
                f"(batch * num_heads, target, source), received {shape}"
            )
        structure, _ = _allowed_bool_or_float("attn_mask", view)
    if padding is None or structure is None:
        return (structure if padding is None else padding), lengths
    if padding.dtype == np.bool_ and structure.dtype == np.bool_:
        return structure & padding, None
    float_dtype = next(m.dtype for m in (structure, padding) if m.dtype != np.bool_)
    as_float = [m if m.dtype != np.bool_ else _as_float(xp, m, float_dtype) for m in (structure, padding)]
    return as_float[0] + as_float[1], None


def cache_options(
    xp: ModuleType,
    starts: np.ndarray,
    lengths: np.ndarray,
    *,
    padded: bool,
    seq_q: int,
    causal: bool,
    window: tuple[int, int] | None,
    backend: str | None,
) -> AttentionOptions:
    """Options for new queries attending to a KV cache after they were appended.

    Row b's queries sit at positions ``starts[b] + i``; its keys are ``[0, lengths[b])`` of a
    buffer view of ``Sk = max(lengths)`` keys.

    Parameters
    ----------
    xp : module
        numpy or cupy (where ``key_lengths`` and a mask must live).
    starts, lengths : numpy.ndarray, int64 (B,)
        Row lengths before and after the append.
    padded : bool
        Whether some rows appended fewer than ``seq_q`` tokens.
    seq_q : int
        New queries per row.
    causal : bool
        Whether each query sees only keys at or before its position.
    window : (int, int) or None
        Sliding window around each query's position.
    backend : str or None
        The layer's backend.

    Returns
    -------
    AttentionOptions
        For ``(B, S, H, D)`` (``"bshd"``) arrays.
        Aligned rows (equal starts, no padding), causal: ``causal="bottom_right"`` (query i sits
        at ``i + Sk - Sq``) with the window.  No window and one token per row (or not causal):
        the same alignment plus ``key_lengths``.  Otherwise (misaligned rows with a window or
        several causal tokens; a window without causality, which fastattn aligns top-left) an
        exact bool mask ``(B, 1, Sq, Sk)`` built from each row's own positions.
    """
    alignment: bool | str = "bottom_right" if causal else False
    seq_k = int(lengths.max())
    aligned = not padded and int(starts.min()) == int(starts.max())
    if aligned and (causal or window is None):
        return AttentionOptions(causal=alignment, window=window, layout="bshd", backend=backend)
    if window is None and (seq_q == 1 or not causal):
        return AttentionOptions(causal=alignment, key_lengths=xp.asarray(lengths), layout="bshd", backend=backend)
    positions = starts[:, None, None] + np.arange(seq_q)[None, :, None]
    keys = np.arange(seq_k)[None, None, :]
    visible = np.broadcast_to(keys < lengths[:, None, None], (lengths.size, seq_q, seq_k)).copy()
    if causal:
        visible &= keys <= positions
    if window is not None:
        left, right = window
        if left >= 0:
            visible &= keys >= positions - left
        if right >= 0 and not causal:
            visible &= keys <= positions + right
    return AttentionOptions(mask=xp.asarray(visible[:, None]), layout="bshd", backend=backend)
