"""The exact float32 kernels on a CUDA device (issue #13); skipped without CuPy and a device.

Forward and backward against the float64 oracle within 1e-5 (the backward relative to the size of
each gradient's terms, as the conformance suite measures it) on every contract feature, head
dimensions from 16 to 256 with Dv != D, both layouts, strided views; the fp32 kernels (not decode)
are asserted to be what ran.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import fastattn
from fastattn import _arrays
from fastattn._gpu import _launch, fp32

from ._poison import poisoned_allocator
from .conformance import _oracle
from .conformance._cases import Case, bhsd_float64, dout_like, make_inputs, relative_error, to_host
from .conformance.test_forward import check_forward

cupy = pytest.importorskip("cupy")
if not fastattn.backends.available()["cuda"].available:
    pytest.skip(f"cuda backend unavailable: {fastattn.backends.available()['cuda']!r}", allow_module_level=True)

TOLERANCE = 1e-5


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results allocated NaN-filled, so an element the kernels never write fails the comparison."""
    monkeypatch.setattr(_arrays, "empty_bhsd", poisoned_allocator())


@pytest.fixture
def fp32_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the fp32 kernels (``flash_fp32.cu``) ran, one entry a launcher: "forward" or "backward".

    Recorded where every launcher fetches its compiled kernels (``_launch.compiled``), since the
    kernel table holds the launchers themselves and a patched module attribute would go unseen."""
    calls: list[str] = []
    original = _launch.compiled

    def recording(source: str, name: str, shared_bytes: int) -> Any:
        if source == fp32.SOURCE:
            direction = "forward" if "fp32_forward" in name else "backward"
            if not calls or calls[-1] != direction:  # a backward launches three kernels
                calls.append(direction)
        return original(source, name, shared_bytes)

    monkeypatch.setattr(_launch, "compiled", recording)
    return calls


def fp32_case(**changes: Any) -> Case:
    base = Case(
        batch=2, heads_kv=2, group=2, seq_q=77, seq_k=131, head_dim=64, head_dim_v=64, dtype="float32",
        layout="bhsd", causal=False, window=None, mask_kind=None, mask_shape=None, key_lengths=None,
        softcap=None, scale=None, strided="contiguous", seed=99,
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


FEATURES: dict[str, dict[str, Any]] = {
    "plain": {},
    "causal-top-left": {"causal": "top_left"},
    "causal-bottom-right": {"causal": "bottom_right"},
    "causal-more-queries-than-keys": {"causal": "bottom_right", "seq_q": 150, "seq_k": 70},
    "window": {"window": (9, 4)},
    "causal-window": {"causal": True, "window": (20, 0)},
    "key-lengths": {"key_lengths": (131, 0)},
    "key-lengths-causal": {"key_lengths": (50, 131), "causal": "bottom_right"},
    "bool-mask": {"mask_kind": "bool", "mask_shape": (2, 4, 77, 131)},
    "float-mask-broadcast": {"mask_kind": "float", "mask_shape": (1, 1, 131)},
    "softcap": {"softcap": 3.0, "scale": 1.1},
    "gqa-8": {"heads_kv": 1, "group": 8},
    "bshd": {"layout": "bshd"},
    "strided": {"strided": "strided"},
    "single-row-and-key": {"seq_q": 1, "seq_k": 1, "head_dim": 80, "head_dim_v": 80},
}
HEAD_DIMS = [(16, 16), (64, 24), (80, 80), (128, 128), (48, 256), (256, 256)]


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda dims: f"D{dims[0]}-Dv{dims[1]}")
def test_forward_matches_float64(feature, head_dims, fp32_calls) -> None:
    case = dataclasses.replace(fp32_case(head_dim=head_dims[0], head_dim_v=head_dims[1]), **FEATURES[feature])
    check_forward("cuda", "cuda", case)  # FORWARD_TOLERANCE["float32"] is 1e-5
    assert fp32_calls == ["forward"] or case.seq_q <= 16


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda dims: f"D{dims[0]}-Dv{dims[1]}")
def test_backward_matches_float64(feature, head_dims, fp32_calls) -> None:
    case = dataclasses.replace(fp32_case(head_dim=head_dims[0], head_dim_v=head_dims[1]), **FEATURES[feature])
    inputs = make_inputs(case, "cuda")
    kwargs = case.kwargs(inputs)
    out, lse = fastattn.attention(inputs["q"], inputs["k"], inputs["v"], return_lse=True, backend="cuda", **kwargs)
    dout = dout_like(case, "cuda")
    fp32_calls.clear()
    dq, dk, dv = fastattn.attention_backward(dout, inputs["q"], inputs["k"], inputs["v"], out, lse, backend="cuda",
                                             **kwargs)  # fmt: skip
    assert fp32_calls == ["backward"]
    q, k, v = (bhsd_float64(inputs[name], case.layout) for name in "qkv")
    expected = _oracle.backward(
        bhsd_float64(dout, case.layout), q, k, v, case.oracle_options(inputs), out=bhsd_float64(out, case.layout)
    )
    for got, want, magnitude, name in zip((dq, dk, dv), expected[:3], expected.magnitudes, ("dq", "dk", "dv")):
        assert got.dtype == cupy.float32
        got64 = bhsd_float64(got, case.layout)
        assert not np.isnan(got64).any(), f"NaN in {name}"
        error = relative_error(got64, want, magnitude)
        assert error <= TOLERANCE, f"{name}: {error:.3g}"
    dq64 = bhsd_float64(dq, case.layout)
    assert np.all(dq64[np.isneginf(to_host(lse))] == 0), "rows that see no key get zero dq"
    if case.key_lengths is not None:
        dk64, dv64 = bhsd_float64(dk, case.layout), bhsd_float64(dv, case.layout)
        for b, length in enumerate(case.key_lengths):
            assert np.all(dk64[b, :, length:] == 0) and np.all(dv64[b, :, length:] == 0)


def test_backward_is_deterministic(fp32_calls) -> None:
    case = fp32_case(causal="bottom_right", group=4, seq_q=300, seq_k=300)
    inputs = make_inputs(case, "cuda")
    out, lse = fastattn.attention(inputs["q"], inputs["k"], inputs["v"], return_lse=True, backend="cuda",
                                  causal="bottom_right")  # fmt: skip
    dout = dout_like(case, "cuda")
    first = fastattn.attention_backward(dout, inputs["q"], inputs["k"], inputs["v"], out, lse, causal="bottom_right")
    second = fastattn.attention_backward(dout, inputs["q"], inputs["k"], inputs["v"], out, lse, causal="bottom_right")
    for a, b in zip(first, second):
        assert cupy.array_equal(a, b)


def test_torch_autograd_in_float32_runs_on_the_gpu_kernels(fp32_calls) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from fastattn.torch import attention as torch_attention

    generator = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (
        torch.randn((2, 4, 100, 64), device="cuda", generator=generator, requires_grad=True) for _ in range(3)
    )
    torch_attention(q, k, v, causal=True).square().sum().backward()
    assert fp32_calls == ["forward", "backward"]
    reference = [x.detach().double().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*reference, is_causal=True).square().sum().backward()
    for ours, exact in zip((q, k, v), reference):
        assert relative_error(ours.grad.double().cpu().numpy(), exact.grad.cpu().numpy()) <= 1e-4
