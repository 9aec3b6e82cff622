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

from . import _arrays, _validation, distributed, functional
from ._options import AttentionOptions
from ._validation import PreparedCall
from .backends import registry
from .backends.registry import UnsupportedError

__all__ = ["attention", "ring_attention", "scaled_dot_product_attention", "ulysses_attention"]


class _AttentionFunction(torch.autograd.Function):
    """``(out, lse) = attention(q, k, v)`` with fastattn's backward; lse carries no gradient.

    The forward's validated call is kept on the context, so the backward checks only ``dout``.
    """

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: PreparedCall
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out_native, lse_native = functional.run_forward(call)
        out, lse = _tensors(call, out_native, lse_native)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # a gradient that did not flow stays None, not a tensor of zeros
        # Saved so that autograd refuses a backward after any of them was modified in place.
        extras = [x for x in (call.options.mask, call.options.key_lengths) if isinstance(x, torch.Tensor)]
        ctx.save_for_backward(q, k, v, out, lse, *extras)
        ctx.call = call
        ctx.natives = out_native, lse_native
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: Any) -> tuple[Any, ...]:
        ctx.saved_tensors  # noqa: B018 (reading them is autograd's check for in-place changes)
        if dout is None:  # no gradient reached out (gradcheck asks this of lse alone): none flows back
            return None, None, None, None
        out, lse = ctx.natives
        call = _validation.prepare_gradient(ctx.call, out, lse, dout)
        dq, dk, dv = functional.finish_backward(call)
        wanted = ctx.needs_input_grad
        return (dq if wanted[0] else None, dk if wanted[1] else None, dv if wanted[2] else None, None)


def _tensors(call: PreparedCall, out: Any, lse: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's native ``(out, lse)`` as tensors in the caller's layout, sharing memory."""
    result = _arrays.from_native(_arrays.swap_layout(out, call.problem.layout), call.origin)
    return result, _arrays.from_native(lse, call.origin)


def _needs_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a gradient can flow from the call's output to its inputs."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def _run(
    call: PreparedCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, needs_grad: bool
) -> tuple[torch.Tensor, Any]:
    """``(out, lse)`` of a validated call: through autograd when a gradient can flow, else directly
    (then lse is None unless the options ask for it)."""
    if needs_grad:
        return _AttentionFunction.apply(q, k, v, call)
    returned = functional.finish_forward(call)
    return returned if call.options.return_lse else (returned, None)


def _backend_for(backend: Any, needs_grad: bool) -> Any:
    """The backend a call names; with a gradient to come, the one requested now (by the argument,
    ``use_backend`` or ``FASTATTN_BACKEND``), which then runs the backward too.  Without one, the
    argument as given: selection reads the rest once, when the call runs."""
    return registry.requested_backend(backend)[0] if needs_grad else backend


def _dropout_seed(dropout_p: Any, dropout_seed: Any) -> Any:
    """A seed from torch's default generator when dropout is asked for without one (a bad
    ``dropout_p`` is refused by the validation that follows)."""
    if dropout_seed is None and dropout_p:
        return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())
    return dropout_seed


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
    _check_mask("mask", mask)
    needs_grad = _needs_grad(q, k, v)
    options = AttentionOptions(
        causal, scale, mask, key_lengths, window, softcap, layout, dropout_p, _dropout_seed(dropout_p, dropout_seed),
        dropout_offset, return_lse, _backend_for(backend, needs_grad),
    )  # fmt: skip
    call = _validation.prepare("forward", {"q": q, "k": k, "v": v}, options)
    out, lse = _run(call, q, k, v, needs_grad)
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
    if attn_mask is not None:
        _check_mask("attn_mask", attn_mask)
    # _needs_grad and _backend_for, written out: this is the drop-in's per-call path, where their two
    # calls measured 1.48-1.49x torch's time against 1.50-1.58x (bench_overhead.py; the goal is 1.5x).
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    arguments = functional.sdpa_arguments(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        dropout_seed=_dropout_seed(dropout_p, None) if dropout_p else None,
        backend=registry.requested_backend(None)[0] if needs_grad else None,
    )  # fmt: skip
    if needs_grad:
        out = _AttentionFunction.apply(arguments.query, arguments.key, arguments.value, arguments.call)[0]
    else:
        out = functional.finish_forward(arguments.call)
    return out[:, 0] if arguments.unbatched_heads else out


class _ShardedFunction(torch.autograd.Function):
    """``(out, lse)`` of a sharded strategy (ring or Ulysses) with its collective backward."""

    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, strategy: str, options: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        forward, _ = _STRATEGIES[strategy]
        out, lse = forward(q.detach(), k.detach(), v.detach(), return_lse=True, **options)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.strategy, ctx.options = strategy, options
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor, dlse: Any) -> tuple[Any, ...]:
        # Collective: every rank runs it, a rank whose loss ignored out with a zero dout.
        q, k, v, out, lse = ctx.saved_tensors
        _, backward = _STRATEGIES[ctx.strategy]
        dq, dk, dv = backward(dout, q, k, v, out, lse, **ctx.options)
        wanted = ctx.needs_input_grad
        return (dq if wanted[0] else None, dk if wanted[1] else None, dv if wanted[2] else None, None, None)


_STRATEGIES = {
    "ring": (distributed.ring_attention, distributed.ring_attention_backward),
    "ulysses": (distributed.ulysses_attention, distributed.ulysses_attention_backward),
}


def _sharded(strategy: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool, **options: Any) -> Any:
    if _needs_grad(q, k, v):
        out, lse = _ShardedFunction.apply(q, k, v, strategy, options)
    else:
        out, lse = _STRATEGIES[strategy][0](q, k, v, return_lse=True, **options)
    return (out, lse) if return_lse else out


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    comm: Any,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    key_lengths: Any = None,
    sharding: str = "zigzag",
    layout: str = "bhsd",
    return_lse: bool = False,
    backend: str | None = None,
) -> Any:
    """:func:`fastattn.distributed.ring_attention` on torch tensors, differentiable with respect to
    this rank's q, k and v shards.

    The backward is collective like the forward: every rank of ``comm`` must run
    ``loss.backward()`` (a rank whose loss does not use the output sends zero gradients).

    Parameters
    ----------
    q, k, v : torch.Tensor
        This rank's shards (see :func:`fastattn.distributed.ring_attention`).
    comm, causal, scale, window, softcap, key_lengths, sharding, layout, backend
        As for :func:`fastattn.distributed.ring_attention`; ``comm`` is usually a
        :class:`fastattn.distributed.TorchCommunicator`.
    return_lse : bool
        Also return this rank's rows of the log-sum-exp (detached).

    Returns
    -------
    out : torch.Tensor, (B, Hq, Sq_r, Dv)
    lse : torch.Tensor, (B, Hq, Sq_r)
        Only with ``return_lse=True``.
    """
    options = dict(
        comm=comm, causal=causal, scale=scale, window=window, softcap=softcap, key_lengths=key_lengths,
        sharding=sharding, layout=layout, backend=backend,
    )  # fmt: skip
    return _sharded("ring", q, k, v, return_lse, **options)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    comm: Any,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    key_lengths: Any = None,
    sharding: str = "zigzag",
    layout: str = "bhsd",
    return_lse: bool = False,
    backend: str | None = None,
) -> Any:
    """:func:`fastattn.distributed.ulysses_attention` on torch tensors, with autograd (parameters
    and returns as :func:`ring_attention`)."""
    options = dict(
        comm=comm, causal=causal, scale=scale, window=window, softcap=softcap, key_lengths=key_lengths,
        sharding=sharding, layout=layout, backend=backend,
    )  # fmt: skip
    return _sharded("ulysses", q, k, v, return_lse, **options)
