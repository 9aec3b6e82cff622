"""The cuda backend on a CUDA device: what only a GPU can check beyond the conformance suite.

Skipped without CuPy and a device.  (The conformance suite already runs every test on the cuda
backend with CuPy inputs wherever a device is present.)
"""

from __future__ import annotations

import numpy as np
import pytest

import fastattn

cupy = pytest.importorskip("cupy")
if not fastattn.backends.available()["cuda"].available:
    pytest.skip(f"cuda backend unavailable: {fastattn.backends.available()['cuda']!r}", allow_module_level=True)


def _error(result, exact) -> float:
    return float(np.linalg.norm(result - exact) / np.linalg.norm(exact))


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_error_no_worse_than_twice_torch_sdpa(head_dim: int, dtype: str, causal) -> None:
    """Against float64, in the same dtype, on the same inputs: at most 2x torch's own error."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    generator = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(2**31)))
    shape_q, shape_kv = (2, 8, 300, head_dim), (2, 2, 333, head_dim)
    q64 = torch.randn(shape_q, device="cuda", dtype=torch.float64, generator=generator)
    k64 = torch.randn(shape_kv, device="cuda", dtype=torch.float64, generator=generator)
    v64 = torch.randn(shape_kv, device="cuda", dtype=torch.float64, generator=generator)
    low = getattr(torch, dtype)
    q, k, v = (x.to(low) for x in (q64, k64, v64))
    exact = fastattn.attention(*(x.to(low).double() for x in (q64, k64, v64)), causal=causal, backend="reference")
    ours = fastattn.attention(q, k, v, causal=causal, backend="cuda")
    assert isinstance(ours, torch.Tensor) and ours.dtype == low and ours.is_cuda
    if causal:
        bias = torch.ones(300, 333, dtype=torch.bool, device="cuda").tril(333 - 300)
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
    else:
        theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    exact_host = exact.cpu().numpy()
    assert _error(ours.double().cpu().numpy(), exact_host) <= 2 * _error(theirs.double().cpu().numpy(), exact_host)


def test_declines_what_it_does_not_run_with_reasons() -> None:
    q = cupy.zeros((1, 2, 8, 80), dtype=cupy.float16)
    explanation = fastattn.explain(q, q, q)
    assert any("head_dim" in reason for reason in explanation.reasons["cuda"])
    assert explanation.chosen == "reference"


def test_float64_runs_on_the_reference_through_cupy() -> None:
    rng = np.random.default_rng(3)
    q, k, v = (cupy.asarray(rng.standard_normal((1, 2, 8, 80))) for _ in range(3))
    explanation = fastattn.explain(q, k, v)
    assert explanation.reasons["cuda"] == ["float64 runs on the reference backend through CuPy"]
    assert explanation.chosen == "reference"
    out = fastattn.attention(q, k, v)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float64
    expected = fastattn.attention(q.get(), k.get(), v.get(), backend="reference")
    assert _error(out.get(), expected) <= 1e-12


# --------------------------------------------------------------------------------------------------
# backward

BATCH, HEADS_Q, HEADS_KV, SEQ_Q, SEQ_K = 2, 8, 2, 300, 333
#: Each case: fastattn options, and whether torch SDPA can express it through attn_mask.
BACKWARD_CASES = {
    "gqa": {},
    "causal-top-left": {"causal": "top_left"},
    "causal-bottom-right": {"causal": "bottom_right"},
    "window": {"window": (48, 16)},
    "window-causal": {"causal": "bottom_right", "window": (64, 0)},
    "key-lengths": {"key_lengths": (333, 150)},
    "bool-mask": {"mask": "bool"},
    "float-mask": {"mask": "float"},
    "softcap": {"softcap": 20.0},
    "bshd": {"layout": "bshd", "causal": "bottom_right"},
}


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return torch


def _visible(torch, options: dict, seq_q: int, seq_k: int):
    """(B|1, 1, Sq, Sk) bool of what causal, window and key_lengths let each query see."""
    offset = seq_k - seq_q if options.get("causal") == "bottom_right" else 0
    position = torch.arange(seq_q, device="cuda")[:, None] + offset
    key = torch.arange(seq_k, device="cuda")[None, :]
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device="cuda")
    if options.get("causal"):
        visible &= key <= position
    if options.get("window"):
        left, right = options["window"]
        if left >= 0:
            visible &= key >= position - left
        if right >= 0:
            visible &= key <= position + right
    visible = visible[None, None]
    if options.get("key_lengths"):
        lengths = torch.tensor(options["key_lengths"], device="cuda")
        visible = visible & (key[None, None] < lengths[:, None, None, None])
    return visible


class _Problem:
    """Random float64 inputs on the GPU, the case's options, and its SDPA-equivalent attn_mask."""

    def __init__(self, torch, case: str, head_dim: int, seed: int, seq_q: int = SEQ_Q, seq_k: int = SEQ_K) -> None:
        generator = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape):
            return torch.randn(shape, device="cuda", dtype=torch.float64, generator=generator)

        self.torch = torch
        self.q64 = randn(BATCH, HEADS_Q, seq_q, head_dim)
        self.k64, self.v64 = randn(BATCH, HEADS_KV, seq_k, head_dim), randn(BATCH, HEADS_KV, seq_k, head_dim)
        self.dout64 = randn(BATCH, HEADS_Q, seq_q, head_dim)
        spec = dict(BACKWARD_CASES[case])
        self.layout = spec.pop("layout", "bhsd")
        self.softcap = spec.get("softcap")
        mask_kind = spec.pop("mask", None)
        self.options = dict(spec)
        masked = mask_kind or any(name in spec for name in ("causal", "window", "key_lengths"))
        self.attn_mask = _visible(torch, spec, seq_q, seq_k) if masked else None  # None: SDPA's flash path
        if mask_kind == "bool":
            mask = torch.rand(BATCH, 1, seq_q, seq_k, device="cuda", generator=generator) < 0.7
            mask[..., 0] = True  # every row sees a key: SDPA would give NaN otherwise
            self.options["mask"] = mask
            self.attn_mask = self.attn_mask & mask
        elif mask_kind == "float":
            mask = torch.randn(1, HEADS_Q, seq_q, seq_k, device="cuda", generator=generator, dtype=torch.float32)
            self.options["mask"] = mask
            self.attn_mask = torch.where(self.attn_mask, mask, float("-inf"))
        if "key_lengths" in spec:
            self.options["key_lengths"] = torch.tensor(spec["key_lengths"], device="cuda")

    def _caller(self, x):
        """A (B, H, S, D) tensor in the case's layout (contiguous there)."""
        return x.transpose(1, 2).contiguous() if self.layout == "bshd" else x

    def _bhsd(self, x):
        return x.transpose(1, 2) if self.layout == "bshd" else x

    def exact(self, low):
        """float64 gradients of the inputs rounded to ``low``, from the reference backend."""
        q, k, v, dout = (self._caller(x.to(low).double()) for x in (self.q64, self.k64, self.v64, self.dout64))
        options = dict(self.options, layout=self.layout, backend="reference")
        out, lse = fastattn.attention(q, k, v, return_lse=True, **options)
        return [self._bhsd(g) for g in fastattn.attention_backward(dout, q, k, v, out, lse, **options)]

    def ours(self, low, deterministic: bool = False):
        """fastattn's cuda forward then backward, in ``low``; gradients in (B, H, S, D) order."""
        q, k, v, dout = (self._caller(x.to(low)) for x in (self.q64, self.k64, self.v64, self.dout64))
        options = dict(self.options, layout=self.layout, backend="cuda")
        out, lse = fastattn.attention(q, k, v, return_lse=True, **options)
        grads = fastattn.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
        for grad, x in zip(grads, (q, k, v)):
            assert grad.dtype == low and grad.shape == x.shape and grad.is_cuda
        return [self._bhsd(g) for g in grads]

    def torchs(self, low):
        """torch's gradients in ``low``: SDPA with the equivalent attn_mask, or eager softcap attention."""
        torch = self.torch
        leaves = [x.to(low).requires_grad_() for x in (self.q64, self.k64, self.v64)]
        scale = 1 / self.q64.shape[-1] ** 0.5
        if self.softcap is None:
            mask = self.attn_mask
            if mask is not None and mask.dtype != torch.bool:
                mask = mask.to(low)
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
        else:  # what Gemma 2 runs in eager mode: scores in the input dtype, softmax in float32
            group = HEADS_Q // HEADS_KV
            k, v = (x.repeat_interleave(group, dim=1) for x in leaves[1:])
            scores = leaves[0] @ k.transpose(-1, -2) * scale
            scores = self.softcap * torch.tanh(scores / self.softcap)
            out = torch.softmax(scores.float(), dim=-1).to(low) @ v
        out.backward(self.dout64.to(low))
        return [leaf.grad for leaf in leaves]


def _errors(grads, exact) -> list[float]:
    """Relative Frobenius error of each gradient against float64."""
    return [float((got.double() - want).norm() / want.norm()) for got, want in zip(grads, exact)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(BACKWARD_CASES))
def test_backward_error_no_worse_than_twice_torch(case: str, dtype: str) -> None:
    """dq, dk, dv against float64 on the same rounded inputs: each within 2x torch's own error."""
    torch = _torch_cuda()
    low = getattr(torch, dtype)
    for head_dim in (64, 128):
        problem = _Problem(torch, case, head_dim, seed=int(np.random.default_rng().integers(2**31)))
        exact = problem.exact(low)
        ours, theirs = _errors(problem.ours(low), exact), _errors(problem.torchs(low), exact)
        for name, mine, anchor in zip(("dq", "dk", "dv"), ours, theirs):
            assert mine <= 2 * anchor, f"head_dim {head_dim} {name}: {mine:.3g} vs torch {anchor:.3g}"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_every_head_dim(head_dim: int, dtype: str, deterministic: bool) -> None:
    torch = _torch_cuda()
    low = getattr(torch, dtype)
    problem = _Problem(torch, "causal-bottom-right", head_dim, seed=head_dim)
    exact = problem.exact(low)
    ours, theirs = _errors(problem.ours(low, deterministic), exact), _errors(problem.torchs(low), exact)
    for name, mine, anchor in zip(("dq", "dk", "dv"), ours, theirs):
        assert mine <= 2 * anchor, f"{name}: {mine:.3g} vs torch {anchor:.3g}"


@pytest.mark.parametrize("case", ["gqa", "window-causal", "key-lengths", "softcap"])
def test_deterministic_backward_is_bit_identical(case: str) -> None:
    torch = _torch_cuda()
    problem = _Problem(torch, case, 128, seed=7)
    first, second = problem.ours(torch.bfloat16, True), problem.ours(torch.bfloat16, True)
    for a, b, name in zip(first, second, ("dq", "dk", "dv")):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("deterministic", [False, True])
def test_unseen_rows_and_padding_keys_get_zero_gradients(deterministic: bool) -> None:
    """Sq > Sk bottom-right leaves the first rows keyless; key_lengths 0 and 70 pad whole tiles."""
    torch = _torch_cuda()
    seq_q, seq_k = 200, 150
    q = torch.randn(BATCH, HEADS_Q, seq_q, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(BATCH, HEADS_KV, seq_k, 64, device="cuda", dtype=torch.float16) for _ in "kv")
    lengths = torch.tensor([0, 70], device="cuda")
    options = {"causal": "bottom_right", "key_lengths": lengths, "backend": "cuda"}
    out, lse = fastattn.attention(q, k, v, return_lse=True, **options)
    dout = torch.randn_like(out)
    dq, dk, dv = fastattn.attention_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options)
    for grad in (dq, dk, dv):
        assert not grad.isnan().any()
    assert torch.equal(dq[lse.isneginf()], torch.zeros_like(dq[lse.isneginf()]))
    assert (dq[0] == 0).all() and (dk[0] == 0).all() and (dv[0] == 0).all()
    assert (dk[1, :, 70:] == 0).all() and (dv[1, :, 70:] == 0).all()
    assert (dq[1, :, : seq_q - seq_k] == 0).all()  # rows before the first key's position


def test_unaligned_dout_and_out_are_copied_not_misread() -> None:
    """Views whose rows are not 16-byte aligned (data offset by 4 elements) give the same gradients."""
    torch = _torch_cuda()
    q = torch.randn(1, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 120, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out, lse = fastattn.attention(q, k, v, return_lse=True, causal=True, backend="cuda")
    dout = torch.randn_like(out)
    wide = torch.zeros(1, 4, 100, 72, device="cuda", dtype=torch.bfloat16)
    wide[..., 4:68] = dout
    shifted = wide[..., 4:68]
    assert shifted.data_ptr() % 16 != 0
    expected = fastattn.attention_backward(dout, q, k, v, out, lse, causal=True, backend="cuda", deterministic=True)
    got = fastattn.attention_backward(shifted, q, k, v, out, lse, causal=True, backend="cuda", deterministic=True)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_backward_is_chosen_for_half_precision() -> None:
    q = cupy.zeros((1, 2, 8, 64), dtype=cupy.float16)
    explanation = fastattn.explain(q, q, q)
    assert explanation.backward_reasons["cuda"] == []
    assert explanation.chosen_backward == "cuda"


@pytest.mark.parametrize("deterministic", [False, True])
def test_nan_values_behind_a_mask_leave_the_backward_finite(deterministic: bool) -> None:
    """dS is exactly 0 wherever P is 0, so a NaN in V at a masked key (dO V^T is NaN there) stays out.

    out and lse come from the reference: the tensor-core forward still multiplies the 0 weights
    inside its mma tiles (README "NaN and infinity")."""
    torch = _torch_cuda()
    q = torch.randn(1, 4, 90, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.float16) for _ in "kv")
    mask = torch.ones(1, 1, 90, 100, dtype=torch.bool, device="cuda")
    mask[..., 17] = False
    v[:, :, 17] = float("nan")
    out, lse = fastattn.attention(q, k, v, mask=mask, return_lse=True, backend="reference")
    dout = torch.randn_like(out)
    grads = fastattn.attention_backward(dout, q, k, v, out, lse, mask=mask, backend="cuda", deterministic=deterministic)
    for grad, name in zip(grads, ("dq", "dk", "dv")):
        assert grad.isfinite().all(), name
