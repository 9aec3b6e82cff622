"""PyTorch autograd for fastattn: attention that ``loss.backward()`` differentiates.

``import fastattn`` never imports torch; importing this module does.  Its two functions take and
return ``torch.Tensor``s and are ``torch.autograd.Function``s over fastattn's own forward and
backward kernels: CPU tensors run on the ``cpu`` backend, CUDA tensors on the ``cuda`` backend
(automatic selection, overridable exactly as for :func:`fastattn.attention`), and tensors cross
into the kernels and back through DLPack without copies.

>>> import torch, fastattn.torch
>>> q = torch.randn(1, 4, 16, 32, requires_grad=True)
>>> k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
>>> fastattn.torch.attention(q, k, v, causal=True).sum().backward()
>>> q.grad.shape
torch.Size([1, 4, 16, 32])

Gradients flow to q, k and v.  ``mask`` and ``key_lengths`` are inputs without a gradient: a float
mask that requires grad raises :class:`fastattn.UnsupportedError` rather than silently getting none.
The backward is not itself differentiable (no double backward).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from . import functional
from .backends import registry
from .backends.registry import UnsupportedError

__all__ = ["attention", "scaled_dot_product_attention"]


class _AttentionFunction(torch.autograd.Function):
    """``(out, lse) = attention(q, k, v)`` with fastattn's backward; lse carries no gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any,
        key_lengths: Any,
        options: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = functional.attention(q, k, v, mask=mask, key_lengths=key_lengths, return_lse=True, **options)
        ctx.mark_non_differentiable(lse)
        extras = {"mask": mask, "key_lengths": key_lengths}
        saved_extras = [name for name, value in extras.items() if isinstance(value, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, lse, *(extras[name] for name in saved_extras))
        ctx.saved_extra_names = saved_extras
        ctx.other_extras = {name: value for name, value in extras.items() if name not in saved_extras}
        ctx.options = options
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: Any) -> tuple[Any, ...]:
        q, k, v, out, lse, *extra_tensors = ctx.saved_tensors
        extras = dict(ctx.other_extras, **dict(zip(ctx.saved_extra_names, extra_tensors)))
        dq, dk, dv = functional.attention_backward(dout, q, k, v, out, lse, **extras, **ctx.options)
        wanted = ctx.needs_input_grad
        return (dq if wanted[0] else None, dk if wanted[1] else None, dv if wanted[2] else None, None, None, None)


def _check_mask(name: str, mask: Any) -> None:
    if isinstance(mask, torch.Tensor) and mask.requires_grad:
        raise UnsupportedError(
            f"{name}: expected a mask that does not require grad, received one with requires_grad=True",
            [f"fastattn computes no gradient with respect to a mask; pass {name}.detach()"],
        )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
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
    """:func:`fastattn.attention` on torch tensors, differentiable with respect to q, k and v.

    Parameters
    ----------
    q : torch.Tensor, (B, Hq, Sq, D)
        float16, bfloat16, float32 or float64, on the CPU or a CUDA device.
    k : torch.Tensor, (B, Hkv, Sk, D)
        Same dtype and device as q; ``Hq % Hkv == 0`` (grouped-query attention).
    v : torch.Tensor, (B, Hkv, Sk, Dv)
        Same dtype and device as q.
    causal, scale, window, softcap, layout
        As in :func:`fastattn.attention` (``layout="bshd"`` takes ``(B, S, H, D)`` tensors).
    mask : torch.Tensor, optional
        Bool or float, broadcastable to ``(B, Hq, Sq, Sk)``.  No gradient is computed for it: one
        with ``requires_grad=True`` raises :class:`fastattn.UnsupportedError`.
    key_lengths : torch.Tensor of int, (B,), optional
        Keys ``j >= key_lengths[b]`` are padding.
    dropout_p, dropout_seed, dropout_offset
        Attention dropout as in :func:`fastattn.attention`; the backward regenerates the same
        mask.  Without a seed, one is drawn from torch's default generator, so
        ``torch.manual_seed`` makes the mask reproducible.
    return_lse : bool
        Also return the rows' log-sum-exp, float32 ``(B, Hq, Sq)`` (float64 for float64 inputs),
        detached: no gradient flows back through it.
    backend : str, optional
        Run forward and backward on this backend.  The backend requested when the forward runs
        (by this argument, :func:`fastattn.use_backend` or ``FASTATTN_BACKEND``) also runs the
        backward, even when ``loss.backward()`` is called outside the ``use_backend`` block.

    Returns
    -------
    out : torch.Tensor, (B, Hq, Sq, Dv)
        In q's dtype, on q's device, with a ``grad_fn`` when q, k or v requires grad.
    lse : torch.Tensor, (B, Hq, Sq)
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError, ValueError
        Invalid arguments, exactly as :func:`fastattn.attention` raises them.
    UnsupportedError
        The requested backend cannot run the call, or ``mask`` requires grad.
    """
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, received {return_lse!r}")
    _check_mask("mask", mask)
    functional.check_backend_argument(backend)
    if dropout_seed is None and dropout_p:  # (a bad dropout_p is refused by the validation below)
        dropout_seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    options = {
        "causal": causal,
        "scale": scale,
        "window": window,
        "softcap": softcap,
        "layout": layout,
        "dropout_p": dropout_p,
        "dropout_seed": dropout_seed,
        "dropout_offset": dropout_offset,
        "backend": registry.requested_backend(backend)[0],
    }
    out, lse = _AttentionFunction.apply(q, k, v, mask, key_lengths, options)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on fastattn's kernels, with autograd.

    Parameters
    ----------
    query : torch.Tensor, (N, Hq, L, E) or (N, L, E)
    key : torch.Tensor, (N, Hkv, S, E) or (N, S, E)
    value : torch.Tensor, (N, Hkv, S, Ev) or (N, S, Ev)
    attn_mask : torch.Tensor, optional
        Broadcastable to ``(N, Hq, L, S)``: bool (True = takes part) or float (added to the
        scores); it gets no gradient, and one that requires grad raises
        :class:`fastattn.UnsupportedError`.
    dropout_p : float
        Attention dropout in [0, 1], applied on every call like PyTorch's, with a seed drawn from
        torch's default generator (``torch.manual_seed`` reproduces it).
    is_causal : bool
        Top-left causal mask; not allowed together with ``attn_mask``.
    scale : float, optional
        ``1 / sqrt(E)`` by default.
    enable_gqa : bool
        Allow ``Hkv < Hq`` with ``Hq % Hkv == 0``; without it the head counts must match.

    Returns
    -------
    torch.Tensor, (N, Hq, L, Ev) or (N, L, Ev)
        In query's dtype and on its device, differentiable with respect to query, key and value.
        Unlike PyTorch, a row that sees no key gives zeros (and zero gradients), not NaN.
    """
    _check_mask("attn_mask", attn_mask)
    arguments = functional.sdpa_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out = attention(
        arguments.query,
        arguments.key,
        arguments.value,
        causal=is_causal,
        scale=scale,
        mask=arguments.attn_mask,
        dropout_p=dropout_p,
    )
    return out[:, 0] if arguments.unbatched_heads else out
