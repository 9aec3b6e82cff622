"""Parity with ``torch.nn.functional.scaled_dot_product_attention``, forward and autograd backward.

torch tensors go in and come out, so this also exercises the DLPack path.  Masks here leave every
row at least one key: PyTorch returns NaN for a row that sees nothing, where our contract says 0.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastattn

from . import _oracle
from ._cases import relative_error

torch = pytest.importorskip("torch")

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
BACKWARD_TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


@st.composite
def torch_problems(draw):
    heads_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    batch = draw(st.integers(1, 2))
    seq_q, seq_k = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    full = (batch, heads_kv * group, seq_q, seq_k)
    ndim = draw(st.integers(2, 4))
    return {
        "batch": batch,
        "heads_kv": heads_kv,
        "group": group,
        "seq_q": seq_q,
        "seq_k": seq_k,
        "head_dim": draw(st.sampled_from([16, 32, 64])),
        "head_dim_v": draw(st.sampled_from([16, 24, 64])),
        "dtype": draw(st.sampled_from(["float64", "float32"])),
        "mask_kind": mask_kind,
        "mask_shape": tuple(draw(st.sampled_from([1, size])) for size in full[4 - ndim :]),
        "is_causal": mask_kind is None and draw(st.booleans()),
        "scale": draw(st.one_of(st.none(), st.floats(0.05, 1.0))),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _tensors(problem):
    generator = torch.Generator().manual_seed(problem["seed"])
    dtype = getattr(torch, problem["dtype"])

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    batch, heads_q = problem["batch"], problem["heads_kv"] * problem["group"]
    q = randn(batch, heads_q, problem["seq_q"], problem["head_dim"])
    k = randn(batch, problem["heads_kv"], problem["seq_k"], problem["head_dim"])
    v = randn(batch, problem["heads_kv"], problem["seq_k"], problem["head_dim_v"])
    mask = None
    if problem["mask_kind"] == "bool":
        mask = torch.rand(problem["mask_shape"], generator=generator) < 0.7
        mask[..., 0] = True
    elif problem["mask_kind"] == "float":
        mask = randn(*problem["mask_shape"])
    return q, k, v, mask


@settings(max_examples=150)
@given(problem=torch_problems())
def test_forward_matches_torch(backend: str, problem) -> None:
    q, k, v, mask = _tensors(problem)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=problem["is_causal"], scale=problem["scale"], enable_gqa=True
    )
    explanation = fastattn.explain(q, k, v, mask=mask, causal=problem["is_causal"], scale=problem["scale"])
    if explanation.reasons[backend]:
        return
    with fastattn.use_backend(backend):
        got = fastattn.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=problem["is_causal"], scale=problem["scale"], enable_gqa=True
        )
    assert isinstance(got, torch.Tensor) and got.dtype == q.dtype
    assert relative_error(got.numpy(), expected.numpy()) <= TOLERANCE[problem["dtype"]]


@settings(max_examples=100)
@given(problem=torch_problems())
def test_backward_matches_torch_autograd(backend: str, problem) -> None:
    q, k, v, mask = _tensors(problem)
    options = {"mask": mask, "causal": problem["is_causal"], "scale": problem["scale"]}
    if fastattn.explain(q, k, v, **options).backward_reasons[backend]:
        return
    leaves = [tensor.clone().requires_grad_() for tensor in (q, k, v)]
    expected_out = torch.nn.functional.scaled_dot_product_attention(
        *leaves, attn_mask=mask, is_causal=problem["is_causal"], scale=problem["scale"], enable_gqa=True
    )
    dout = torch.randn(expected_out.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(problem["seed"] + 1))
    expected_out.backward(dout)
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="reference", **options)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, backend=backend, **options)
    # The oracle's term magnitudes are the yardstick: a gradient that cancels to ~0 (one visible
    # key gives dq = 0 exactly) is rounding noise in both implementations.
    oracle_mask = None if mask is None else mask.numpy().astype(np.float64 if mask.is_floating_point() else bool)
    magnitudes = _oracle.backward(
        dout.double().numpy(),
        *(tensor.double().numpy() for tensor in (q, k, v)),
        _oracle.Options(causal=problem["is_causal"], scale=problem["scale"], mask=oracle_mask),
    ).magnitudes
    for got, leaf, magnitude, name in zip(grads, leaves, magnitudes, "qkv"):
        assert isinstance(got, torch.Tensor)
        error = relative_error(got.numpy(), leaf.grad.numpy(), magnitude)
        assert error <= BACKWARD_TOLERANCE[problem["dtype"]], f"d{name}: {error:.3g}"


def test_gqa_without_enable_gqa_is_refused_like_torch() -> None:
    rng = np.random.default_rng()
    q = torch.from_numpy(rng.standard_normal((1, 4, 3, 16)))
    k = torch.from_numpy(rng.standard_normal((1, 2, 3, 16)))
    with pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, k)
    with pytest.raises(ValueError, match="^key:"):
        fastattn.scaled_dot_product_attention(q, k, k)
