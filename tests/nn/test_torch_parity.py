"""Parity with torch.nn.MultiheadAttention holding the same weights: outputs, weights, gradients.

float64 throughout, within 1e-10.  Masks leave every query row at least one key (torch gives NaN
for a row that sees nothing, fastattn 0).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastattn.nn import MultiheadAttention

from ._helpers import max_error

torch = pytest.importorskip("torch")

EMBED, HEADS, BATCH, SEQ_Q, SEQ_K = 12, 3, 2, 5, 7
MASKS = [
    "none",
    "padding-scattered",
    "padding-right",
    "padding-float",
    "attn-bool-2d",
    "attn-bool-3d",
    "attn-float-2d",
    "attn-float-3d",
    "causal",
    "padding-and-attn-bool",
]
INPUTS = ["self", "kv-shared", "distinct"]
CASES = [
    (mask, inputs, index % 2 == 0, index % 3 != 1)
    for index, (mask, inputs) in enumerate(itertools.product(MASKS, INPUTS))
]


def _torch_layer(generator, batch_first, bias):
    layer = torch.nn.MultiheadAttention(EMBED, HEADS, bias=bias, batch_first=batch_first, dtype=torch.float64)
    if bias:
        with torch.no_grad():
            layer.in_proj_bias.normal_(generator=generator)
            layer.out_proj.bias.normal_(generator=generator)
    return layer


def _masks(kind, seq_q, seq_k, generator, batch=BATCH):
    """torch-convention (attn_mask, key_padding_mask, torch is_causal, ours is_causal)."""
    attn_mask = padding = None
    if kind.startswith("padding-") and kind != "padding-float":
        if kind == "padding-right":
            lengths = torch.tensor([seq_k, 3])[:batch]
            padding = torch.arange(seq_k)[None, :] >= lengths[:, None]
        else:
            padding = torch.rand(batch, seq_k, generator=generator) < 0.4
            padding[:, 0] = False
    elif kind == "padding-float":
        padding = torch.randn(batch, seq_k, generator=generator, dtype=torch.float64)
    if kind in ("attn-bool-2d", "padding-and-attn-bool"):
        attn_mask = torch.rand(seq_q, seq_k, generator=generator) < 0.3
        attn_mask[:, 0] = False
    elif kind == "attn-bool-3d":
        attn_mask = torch.rand(batch * HEADS, seq_q, seq_k, generator=generator) < 0.3
        attn_mask[..., 0] = False
    elif kind == "attn-float-2d":
        attn_mask = torch.randn(seq_q, seq_k, generator=generator, dtype=torch.float64)
    elif kind == "attn-float-3d":
        attn_mask = torch.randn(batch * HEADS, seq_q, seq_k, generator=generator, dtype=torch.float64)
    if kind == "causal":
        causal_mask = torch.triu(torch.ones(seq_q, seq_k, dtype=torch.bool), diagonal=1)
        return causal_mask, None, True, True
    return attn_mask, padding, False, None


def _grads_in_our_names(module):
    """torch's parameter gradients renamed and split as our layer names them."""
    return {
        "q_proj.weight": module.in_proj_weight.grad[:EMBED],
        "k_proj.weight": module.in_proj_weight.grad[EMBED : 2 * EMBED],
        "v_proj.weight": module.in_proj_weight.grad[2 * EMBED :],
        "o_proj.weight": module.out_proj.weight.grad,
        **(
            {
                "q_proj.bias": module.in_proj_bias.grad[:EMBED],
                "k_proj.bias": module.in_proj_bias.grad[EMBED : 2 * EMBED],
                "v_proj.bias": module.in_proj_bias.grad[2 * EMBED :],
                "o_proj.bias": module.out_proj.bias.grad,
            }
            if module.in_proj_bias is not None
            else {}
        ),
    }


@pytest.mark.parametrize(("mask", "inputs", "batch_first", "bias"), CASES)
def test_outputs_and_gradients_match_torch(mask, inputs, batch_first, bias, rng):
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    reference = _torch_layer(generator, batch_first, bias)
    ours = MultiheadAttention(EMBED, HEADS, bias=bias, batch_first=batch_first, dtype=np.float64, seed=rng)
    ours.load_state_dict(reference.state_dict())
    seq_k = SEQ_Q if inputs == "self" or mask == "causal" else SEQ_K

    def tensor(seq):
        shape = (BATCH, seq, EMBED) if batch_first else (seq, BATCH, EMBED)
        return torch.randn(*shape, generator=generator, dtype=torch.float64, requires_grad=True)

    query = tensor(SEQ_Q)
    if inputs == "self":
        leaves, (key, value) = [query], (query, query)
    elif inputs == "kv-shared":
        memory = tensor(seq_k)
        leaves, (key, value) = [query, memory], (memory, memory)
    else:
        key, value = tensor(seq_k), tensor(seq_k)
        leaves = [query, key, value]
    attn_mask, padding, torch_causal, our_causal = _masks(mask, SEQ_Q, seq_k, generator)
    expected, _ = reference(
        query, key, value, attn_mask=attn_mask, key_padding_mask=padding, need_weights=False, is_causal=torch_causal
    )
    our_key = None if inputs == "self" else key
    our_value = value if inputs == "distinct" else None
    our_mask = None if mask == "causal" else attn_mask
    output = ours(query, our_key, our_value, attn_mask=our_mask, key_padding_mask=padding, is_causal=our_causal)
    assert isinstance(output, torch.Tensor)
    assert max_error(output, expected.detach()) < 1e-10

    grad_output = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    expected.backward(grad_output)
    input_grads = ours.backward(grad_output)
    assert len(input_grads) == len(leaves)
    for leaf, grad in zip(leaves, input_grads):
        assert max_error(grad, leaf.grad) < 1e-10
    torch_grads = _grads_in_our_names(reference)
    assert set(torch_grads) == set(ours.grads)
    for name, grad in torch_grads.items():
        assert max_error(ours.grads[name], grad) < 1e-10, name

    with torch.no_grad():
        expected_out, expected_weights = reference(
            query, key, value, attn_mask=attn_mask, key_padding_mask=padding, need_weights=True
        )
    ours.eval()
    output, weights = ours(
        query, our_key, our_value, attn_mask=our_mask, key_padding_mask=padding, is_causal=our_causal, need_weights=True
    )
    assert max_error(output, expected_out) < 1e-10
    assert weights.shape == expected_weights.shape == (BATCH, SEQ_Q, seq_k)
    assert max_error(weights, expected_weights) < 1e-10


@pytest.mark.parametrize("mask", ["none", "padding-scattered", "attn-bool-3d", "causal"])
def test_unbatched_inputs_match_torch(mask, rng):
    generator = torch.Generator().manual_seed(int(rng.integers(2**31)))
    reference = _torch_layer(generator, batch_first=False, bias=True)
    ours = MultiheadAttention(EMBED, HEADS, batch_first=False, dtype=np.float64)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(SEQ_Q, EMBED, generator=generator, dtype=torch.float64, requires_grad=True)
    attn_mask, padding, torch_causal, our_causal = _masks(mask, SEQ_Q, SEQ_Q, generator, batch=1)
    if attn_mask is not None and attn_mask.ndim == 3:
        attn_mask = attn_mask[:HEADS]
    padding = None if padding is None else padding[0]
    expected, _ = reference(
        x, x, x, attn_mask=attn_mask, key_padding_mask=padding, need_weights=False, is_causal=torch_causal
    )
    output = ours(x, attn_mask=None if mask == "causal" else attn_mask, key_padding_mask=padding, is_causal=our_causal)
    assert output.shape == (SEQ_Q, EMBED)
    assert max_error(output, expected.detach()) < 1e-10
    grad_output = torch.randn(SEQ_Q, EMBED, generator=generator, dtype=torch.float64)
    expected.backward(grad_output)
    (grad,) = ours.backward(grad_output)
    assert max_error(grad, x.grad) < 1e-10


@pytest.mark.parametrize("bias", [True, False])
def test_our_torch_state_dict_loads_into_torch(bias, rng):
    ours = MultiheadAttention(EMBED, HEADS, bias=bias, dtype=np.float64, seed=rng)
    for name, param in ours.named_parameters():
        if name.endswith("bias"):
            param[...] = rng.standard_normal(param.shape)
    state = ours.state_dict(dialect="torch")
    reference = torch.nn.MultiheadAttention(EMBED, HEADS, bias=bias, batch_first=True, dtype=torch.float64)
    assert set(state) == set(reference.state_dict())
    reference.load_state_dict({key: torch.from_numpy(value) for key, value in state.items()})
    x = rng.standard_normal((BATCH, SEQ_Q, EMBED))
    expected, _ = reference(*(torch.from_numpy(x),) * 3, need_weights=False)
    assert max_error(ours(x), expected.detach()) < 1e-10


def test_torch_extras_are_reported_as_unexpected():
    reference = torch.nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"unexpected \['bias_k', 'bias_v'\]"):
        MultiheadAttention(EMBED, HEADS, dtype=np.float64).load_state_dict(reference.state_dict())
