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
