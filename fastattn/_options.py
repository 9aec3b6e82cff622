"""The options of one attention call, as one frozen object.

:func:`fastattn.attention`, :func:`fastattn.attention_backward`, ``fastattn.torch``, the layers of
``fastattn.nn`` and the benchmarks all describe a call with an :class:`AttentionOptions`; the
option list exists here once.  ``fastattn/_validation.py`` checks it, once per call.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class AttentionOptions(NamedTuple):
    """Everything about an attention call but q, k and v (DESIGN.md §3 has the semantics).

    A named tuple: immutable, and cheap enough to build on every call.  Values are as the caller
    gave them; :func:`fastattn._validation.prepare` checks them.

    Attributes
    ----------
    causal : {False, True, "top_left", "bottom_right"}
    scale : float or None
        ``1 / sqrt(D)`` when None.
    mask : array or None
        bool (True = may attend) or float (added), broadcastable to ``(B, Hq, Sq, Sk)``.
    key_lengths : int array (B,) or None
    window : (int, int) or None
        ``(left, right)``, -1 for unbounded.
    softcap : float or None
    layout : {"bhsd", "bshd"}
    dropout_p : float
    dropout_seed : int or None
        The forward draws a fresh seed when None; the backward requires the forward's.
    dropout_offset : int
    return_lse : bool
        Forward only: also return the rows' log-sum-exp.
    backend : str or None
        Run on this backend (or raise); None: ``use_backend``, ``FASTATTN_BACKEND``, automatic.
    """

    causal: bool | str = False
    scale: float | None = None
    mask: Any = None
    key_lengths: Any = None
    window: tuple[int, int] | None = None
    softcap: float | None = None
    layout: str = "bhsd"
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    dropout_offset: int = 0
    return_lse: bool = False
    backend: str | None = None
