"""The public attention functions: validate once, pick a backend, convert in and out.

Shapes (layout ``"bhsd"``, PyTorch's order; ``"bshd"`` swaps axes 1 and 2 at no cost):
q ``(B, Hq, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``, out ``(B, Hq, Sq, Dv)``,
lse ``(B, Hq, Sq)``.  The semantics of every option are those of DESIGN.md §3.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _arrays, _validation
from ._options import AttentionOptions
from ._validation import PreparedCall
from .backends import registry
from .backends.registry import Explanation

__all__ = [
    "attention",
    "attention_backward",
    "explain",
    "scaled_dot_product_attention",
]


def attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool | str = False,
    scale: float | None = None,
    mask: Any = None,
    key_lengths: Any = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    layout: str = "bhsd",
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    return_lse: bool = False,
    backend: str | None = None,
) -> Any:
    """Scaled-dot-product attention, ``softmax(q @ k.T * scale + bias) @ v``, computed exactly.

    Parameters
    ----------
    q : array, (B, Hq, Sq, D)
        Queries: numpy, CuPy, or any DLPack tensor (torch, JAX); float16, bfloat16, float32 or
        float64.  The last axis must be contiguous to avoid a copy; other strides are free.
    k : array, (B, Hkv, Sk, D)
        Keys, same dtype and device as q.  ``Hq % Hkv == 0``; query head h reads kv head
        ``h // (Hq // Hkv)`` (grouped-query attention), without repeating k.
    v : array, (B, Hkv, Sk, Dv)
        Values, same dtype and device as q; ``Dv`` may differ from ``D``.
    causal : {False, True, "top_left", "bottom_right"}
        ``True``/``"top_left"``: key j visible to query i iff ``j <= i`` (PyTorch ``is_causal``);
        ``"bottom_right"``: iff ``j <= i + Sk - Sq`` (FlashAttention >= 2.1, what a KV cache needs).
    scale : float, optional
        Multiplier of the scores; ``1 / sqrt(D)`` by default.
    mask : array, optional
        Broadcastable to ``(B, Hq, Sq, Sk)`` (whatever the layout); bool (True = may attend) or
        float (added to the scores after softcap).  Never expanded.
    key_lengths : int array (B,), optional
        Keys ``j >= key_lengths[b]`` are padding, for every query of batch row b.
    window : (int, int), optional
        Sliding window ``(left, right)``, -1 for unbounded: key j visible iff
        ``i' - left <= j <= i' + right``, where ``i'`` is the query's position under the ``causal``
        alignment (``i``, or ``i + Sk - Sq`` for ``"bottom_right"``; ``i`` when not causal).
        With causal, keys right of ``i'`` stay hidden whatever ``right`` is.
    softcap : float, optional
        Scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2).
    layout : {"bhsd", "bshd"}
        Axis order of q, k, v and out.
    dropout_p : float
        Attention dropout: each probability is dropped with this probability and the kept ones
        scaled by ``1 / (1 - dropout_p)`` (after the softmax; lse is unaffected).  0 = none.
    dropout_seed : int, optional
        Key of the counter-based (Philox4x32-10) mask, in ``[0, 2**64)``; a fresh random seed when
        None.  Pass the same seed (and offset) to :func:`attention_backward`.  Every backend draws
        the same mask for the same seed and offset.
    dropout_offset : int
        Counter offset in ``[0, 2**32)``: an independent mask under the same seed.
    return_lse : bool
        Also return the log-sum-exp of each row's scores.
    backend : str, optional
        Run on this backend or raise :class:`fastattn.UnsupportedError` with its reasons.

    Returns
    -------
    out : array, (B, Hq, Sq, Dv)
        In q's dtype, framework, device and layout.  A query row that sees no key gets zeros.
    lse : array, (B, Hq, Sq)
        Only with ``return_lse=True``: natural log of the row's softmax denominator (scale
        included), float32 (float64 for float64 inputs), in q's framework; ``-inf`` for a row that
        sees no key.
    """
    options = AttentionOptions(
        causal, scale, mask, key_lengths, window, softcap, layout, dropout_p, dropout_seed, dropout_offset,
        return_lse, backend,
    )  # fmt: skip
    return attention_with(q, k, v, options)


def attention_with(q: Any, k: Any, v: Any, options: AttentionOptions) -> Any:
    """:func:`attention` with its options as one object (what the layers and adapters call).

    Parameters
    ----------
    q, k, v : arrays
        As for :func:`attention`.
    options : AttentionOptions
        Every keyword of :func:`attention`.

    Returns
    -------
    out, or (out, lse) with ``options.return_lse``
        As :func:`attention` returns them.
    """
    return finish_forward(_validation.prepare("forward", {"q": q, "k": k, "v": v}, options))


def run_forward(call: PreparedCall) -> tuple[Any, Any]:
    """Run a prepared forward call on its backend; return native ``(out, lse)``, out in
    ``(B, H, S, D)`` order (a view of memory laid out in the call's layout)."""
    problem = call.problem
    chosen = registry.select(problem, call.options.backend)
    if problem.is_empty:
        return _empty_forward(call)
    arrays = call.arrays
    return chosen.forward(problem, arrays["q"], arrays["k"], arrays["v"], call.extras)


def finish_forward(call: PreparedCall) -> Any:
    """Run a prepared forward call and hand the results back in the caller's framework."""
    out, lse = run_forward(call)
    if call.problem.layout == "bshd":
        out = out.swapaxes(1, 2)
    result = _arrays.from_native(out, call.origin)
    if call.options.return_lse:
        return result, _arrays.from_native(lse, call.origin)
    return result


def _zeros_bhsd(xp: Any, shape: tuple[int, int, int, int], dtype: Any, layout: str) -> Any:
    """Zeros of a (B, H, S, D) shape, contiguous in ``layout``."""
    result = _arrays.empty_bhsd(xp, shape, dtype, layout)
    result[...] = 0
    return result


def _empty_forward(call: PreparedCall) -> tuple[Any, Any]:
    """The result of a call with B, Sq or Sk of 0, without a backend: no key means 0 and lse -inf."""
    problem, q = call.problem, call.arrays["q"]
    xp = _arrays.namespace(q)
    shape = (problem.batch, problem.heads_q, problem.seq_q, problem.head_dim_v)
    out = _zeros_bhsd(xp, shape, q.dtype, problem.layout)
    lse = xp.full(shape[:3], -xp.inf, dtype=_arrays.accumulation_dtype(problem.dtype))
    return out, lse


def attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    causal: bool | str = False,
    scale: float | None = None,
    mask: Any = None,
    key_lengths: Any = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    layout: str = "bhsd",
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    backend: str | None = None,
    deterministic: bool = False,
) -> tuple[Any, Any, Any]:
    """Gradients of :func:`attention` with respect to q, k and v.

    Parameters
    ----------
    dout : array, (B, Hq, Sq, Dv)
        Gradient of the loss with respect to ``out``; q's dtype.
    q, k, v : arrays
        The forward's inputs.
    out : array, (B, Hq, Sq, Dv)
        The forward's output.
    lse : array, (B, Hq, Sq)
        The forward's ``lse`` (``return_lse=True``); float32, float64 for float64 inputs.
    causal, scale, mask, key_lengths, window, softcap, layout, dropout_p, dropout_offset, backend
        Exactly as given to the forward.
    dropout_seed : int, optional
        The forward's seed: required when ``dropout_p > 0`` (the mask is regenerated, never stored).
    deterministic : bool
        Make the gradients bit-identical from run to run.  The cpu and reference backends always
        are; the cuda backend then computes dq in a separate pass over query blocks instead of
        adding it through float32 atomics (slower).

    Returns
    -------
    dq : array, (B, Hq, Sq, D)
    dk : array, (B, Hkv, Sk, D)
        Summed over the query heads of each kv head's group.
    dv : array, (B, Hkv, Sk, Dv)
        Summed likewise.  All three in the inputs' dtype, framework, device and layout; rows that
        see no key and keys that nobody sees get exactly zero gradient.
    """
    options = AttentionOptions(
        causal, scale, mask, key_lengths, window, softcap, layout, dropout_p, dropout_seed, dropout_offset,
        False, backend,
    )  # fmt: skip
    return attention_backward_with(dout, q, k, v, out, lse, options, deterministic=deterministic)


def attention_backward_with(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, options: AttentionOptions, *, deterministic: bool = False
) -> tuple[Any, Any, Any]:
    """:func:`attention_backward` with the forward's options as one object.

    Parameters
    ----------
    dout, q, k, v, out, lse, deterministic
        As for :func:`attention_backward`.
    options : AttentionOptions
        The forward's options (``return_lse`` is ignored).

    Returns
    -------
    dq, dk, dv
        As :func:`attention_backward` returns them.
    """
    arrays = {"q": q, "k": k, "v": v, "dout": dout, "out": out, "lse": lse}
    return finish_backward(_validation.prepare("backward", arrays, options, deterministic=deterministic))


def run_backward(call: PreparedCall) -> tuple[Any, Any, Any]:
    """Run a prepared backward call on its backend; return native ``(dq, dk, dv)`` in
    ``(B, H, S, D)`` order (views of memory laid out in the call's layout)."""
    problem = call.problem
    chosen = registry.select(problem, call.options.backend)
    a = call.arrays
    if problem.is_empty:
        return tuple(
            _zeros_bhsd(_arrays.namespace(a[name]), tuple(a[name].shape), a[name].dtype, problem.layout)
            for name in ("q", "k", "v")
        )
    return chosen.backward(problem, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], call.extras)


def finish_backward(call: PreparedCall) -> tuple[Any, Any, Any]:
    """Run a prepared backward call and hand ``(dq, dk, dv)`` back in the caller's framework."""
    problem = call.problem
    grads = run_backward(call)
    return tuple(
        _arrays.from_native(_arrays.swap_layout(grad, problem.layout), call.origin) for grad in grads
    )


def explain(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool | str = False,
    scale: float | None = None,
    mask: Any = None,
    key_lengths: Any = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    layout: str = "bhsd",
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    dropout_offset: int = 0,
    backend: str | None = None,
) -> Explanation:
    """Say which backend would run ``attention(q, k, v, **options)`` and why the others decline.

    Takes the same arguments as :func:`attention` and validates them the same way, but runs
    nothing.  ``print()`` the result for the report; its attributes hold the same facts.

    Returns
    -------
    Explanation
        ``chosen`` (forward), ``chosen_backward``, ``source`` of the choice, and ``reasons`` per
        registered backend.
    """
    options = AttentionOptions(
        causal, scale, mask, key_lengths, window, softcap, layout, dropout_p, dropout_seed, dropout_offset,
        False, backend,
    )  # fmt: skip
    call = _validation.prepare("forward", {"q": q, "k": k, "v": v}, options)
    return registry.explain_problem(call.problem, _validation.backward_problem(call.problem), backend)


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, on fastattn's backends.

    Parameters
    ----------
    query : array, (N, Hq, L, E) or (N, L, E)
    key : array, (N, Hkv, S, E) or (N, S, E)
    value : array, (N, Hkv, S, Ev) or (N, S, Ev)
    attn_mask : array, optional
        Broadcastable to ``(N, Hq, L, S)``: bool (True = takes part) or float (added).
    dropout_p : float
        Attention dropout in [0, 1], applied on every call like PyTorch's (which also ignores
        ``training``), with a fresh random seed each time; use :func:`attention` with
        ``dropout_seed`` for a reproducible mask.
    is_causal : bool
        Top-left causal mask (PyTorch's convention); not allowed together with ``attn_mask``.
    scale : float, optional
        ``1 / sqrt(E)`` by default.
    enable_gqa : bool
        Allow ``Hkv < Hq`` (``Hq % Hkv == 0``); without it the head counts must match.

    Returns
    -------
    array, (N, Hq, L, Ev) or (N, L, Ev)
        In query's dtype, framework and device.  Unlike PyTorch, a row that sees no key gives
        zeros, not NaN.
    """
    arguments = sdpa_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out = finish_forward(arguments.call)
    return out[:, 0] if arguments.unbatched_heads else out


class SdpaArguments(NamedTuple):
    """``scaled_dot_product_attention``'s arguments, validated and mapped onto :func:`attention`'s.

    Attributes
    ----------
    call : PreparedCall
        The validated forward call (errors name query, key, value and attn_mask).
    query, key, value : arrays, (N, H, L, E)
        The caller's arrays, with a head axis of size 1 inserted when they were 3-D.
    attn_mask : array or None
        The caller's mask, likewise given a head axis when it was 3-D.
    unbatched_heads : bool
        Whether the inputs were 3-D, so the result's head axis must be dropped again.
    """

    call: PreparedCall
    query: Any
    key: Any
    value: Any
    attn_mask: Any
    unbatched_heads: bool


def sdpa_arguments(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    *,
    dropout_seed: int | None = None,
    backend: str | None = None,
) -> SdpaArguments:
    """Validate :func:`scaled_dot_product_attention`'s arguments the way PyTorch does.

    Shared by this module and ``fastattn.torch``, so both accept and refuse exactly the same calls.

    Parameters
    ----------
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        As given to :func:`scaled_dot_product_attention`.
    dropout_seed : int, optional
        The dropout mask's seed (``fastattn.torch`` draws it from torch's generator).
    backend : str, optional
        The backend to run on (``fastattn.torch`` fixes it when the forward runs).

    Returns
    -------
    SdpaArguments
        The validated call and the (possibly head-expanded) arrays to hand to :func:`attention`.

    Raises
    ------
    TypeError, ValueError
        An argument is invalid; the message names it.
    """
    if is_causal is not False and is_causal is not True:
        raise TypeError(f"is_causal: expected a bool, received {is_causal!r}")
    if enable_gqa is not False and enable_gqa is not True:
        raise TypeError(f"enable_gqa: expected a bool, received {enable_gqa!r}")
    if is_causal and attn_mask is not None:
        raise ValueError(
            "attn_mask: expected None when is_causal=True (PyTorch's rule), received an array"
        )
    ndim = getattr(query, "ndim", None)
    if ndim != 4 or getattr(key, "ndim", None) != 4 or getattr(value, "ndim", None) != 4:  # not the common case
        ndim = _sdpa_ndim("query", query)
        if _sdpa_ndim("key", key) != ndim or _sdpa_ndim("value", value) != ndim:
            ndims = {"query": ndim, "key": key.ndim, "value": value.ndim}
            raise ValueError(f"key, value: expected the same number of axes as query, received {ndims}")
    unbatched_heads = ndim == 3
    if unbatched_heads:
        query, key, value = (x[:, None] for x in (query, key, value))
        if getattr(attn_mask, "ndim", 0) == 3:
            attn_mask = attn_mask[:, None]
    # tuple.__new__ builds the NamedTuples without their Python-level __new__ (0.1 us each).
    options = tuple.__new__(
        AttentionOptions,
        (is_causal, scale, attn_mask, None, None, None, "bhsd", dropout_p, dropout_seed, 0, False, backend),
    )
    call = _validation.prepare("forward", {"q": query, "k": key, "v": value}, options, labels=_SDPA_LABELS)
    problem = call.problem
    if not enable_gqa and problem.heads_q != problem.heads_kv:  # heads that do not divide raised above
        raise ValueError(
            f"key: expected {problem.heads_q} heads like query (pass enable_gqa=True for grouped-query "
            f"attention), received {problem.heads_kv}"
        )
    return tuple.__new__(SdpaArguments, (call, query, key, value, attn_mask, unbatched_heads))


_SDPA_LABELS = {"q": "query", "k": "key", "v": "value", "mask": "attn_mask"}


def _sdpa_ndim(name: str, array: Any) -> int:
    """The number of axes of an SDPA input, which must be an array of 3 or 4.

    Only what has no ``ndim`` is asked whether it is an array here; anything else that is not one
    is refused with the same message when the call is prepared.
    """
    ndim = getattr(array, "ndim", None)
    if ndim is None:
        raise TypeError(
            f"{name}: expected a numpy array, a CuPy array or a DLPack-capable tensor, "
            f"received {_arrays.describe_value(array)}"
        )
    if ndim != 3 and ndim != 4:
        raise ValueError(
            f"{name}: expected a 4-D (N, H, L, E) or 3-D (N, L, E) array, received {_arrays.describe_value(array)}"
        )
    return int(ndim)

