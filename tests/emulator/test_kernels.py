"""Every CUDA kernel family, unchanged, run by the SIMT emulator through the real launchers and the
cuda backend's own code (``_launch.emulated()``: numpy arrays stand in for device arrays), against
the float64 reference with the conformance suite's tolerances.  Small shapes: a few tiles each, tile
edges and partial tiles included."""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _arrays, _validation
from fastattn._gpu import _launch
from fastattn._options import AttentionOptions
from fastattn.backends.cuda import CudaBackend

from ..conformance._cases import BACKWARD_TOLERANCE, FORWARD_TOLERANCE, relative_error

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": _arrays.bfloat16}


def _inputs(dtype: str, b: int, hq: int, hkv: int, sq: int, sk: int, d: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng()
    shapes = {"q": (b, hq, sq, d), "k": (b, hkv, sk, d), "v": (b, hkv, sk, d), "dout": (b, hq, sq, d)}
    return {name: rng.standard_normal(shape).astype(DTYPES[dtype]) for name, shape in shapes.items()}


def _reference(arrays: dict[str, np.ndarray], options: AttentionOptions) -> tuple[np.ndarray, ...]:
    q, k, v, dout = (arrays[name].astype(np.float64) for name in ("q", "k", "v", "dout"))
    kwargs = {"causal": options.causal, "key_lengths": options.key_lengths, "window": options.window}
    kwargs["softcap"] = options.softcap
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="reference", **kwargs)
    return (out, lse, *fastattn.attention_backward(dout, q, k, v, out, lse, backend="reference", **kwargs))


FORWARDS = [
    # dtype, (B, Hq, Hkv, Sq, Sk, D), options: the tensor-core and float32 forwards, then decode
    ("float32", (1, 4, 2, 37, 53, 64), AttentionOptions(causal="bottom_right")),
    ("float16", (1, 2, 1, 70, 90, 64), AttentionOptions(causal=True)),
    ("float16", (1, 1, 1, 64, 200, 32), AttentionOptions()),  # four key tiles: the stages are reused
    ("bfloat16", (2, 2, 2, 65, 40, 32), AttentionOptions(window=(16, 3), softcap=5.0)),
    ("float16", (2, 4, 2, 1, 300, 64), AttentionOptions(key_lengths=np.array([200, 300]))),
    ("float32", (2, 4, 2, 3, 300, 64), AttentionOptions(causal="bottom_right")),
    # head_dim 256 (the largest tiles; the conformance suite draws D up to 128) and 96
    ("bfloat16", (1, 2, 1, 40, 70, 256), AttentionOptions(causal=True)),
    ("float32", (1, 2, 1, 30, 40, 256), AttentionOptions()),
    ("float16", (1, 2, 2, 33, 45, 96), AttentionOptions(softcap=10.0)),
    # interior tiles (no masking) between edge tiles on both sides, with and without softcap
    # (a block of rows 192-255 has edge tiles for its window's left side and interior tiles after)
    ("float16", (1, 2, 1, 400, 400, 64), AttentionOptions(window=(100, 200))),
    ("bfloat16", (1, 2, 1, 70, 300, 64), AttentionOptions(causal="bottom_right", softcap=3.0)),
]


@pytest.mark.parametrize(("dtype", "sizes", "options"), FORWARDS)
def test_forward_kernels_match_the_reference(dtype: str, sizes: tuple[int, ...], options: AttentionOptions) -> None:
    arrays = _inputs(dtype, *sizes)
    call = _validation.prepare("forward", {name: arrays[name] for name in "qkv"}, options)
    backend = CudaBackend()
    with _launch.emulated():
        assert backend.not_supported_reasons(call.problem) == []
        out, lse = backend.forward(call.problem, arrays["q"], arrays["k"], arrays["v"], call.extras)
    expected_out, expected_lse = _reference(arrays, options)[:2]
    assert relative_error(out.astype(np.float64), expected_out) <= FORWARD_TOLERANCE[dtype]
    seen = ~np.isneginf(expected_lse)
    assert np.array_equal(np.isneginf(lse), ~seen)
    scale = np.maximum(np.abs(expected_lse[seen]), 1.0)
    assert relative_error(lse[seen].astype(np.float64), expected_lse[seen], scale) <= FORWARD_TOLERANCE[dtype]


#: Tensor-core forwards whose V holds inf/NaN at keys some rows of a tile see and others do not.
NONFINITE_FORWARDS = [
    ("float16", (1, 2, 1, 70, 90, 64), AttentionOptions(causal=True)),
    ("bfloat16", (1, 2, 1, 40, 70, 128), AttentionOptions(window=(16, 3))),
]


def check_nonfinite_forward(dtype: str, sizes: tuple[int, ...], options: AttentionOptions) -> None:
    """inf and NaN in V at keys inside the causal diagonal (or the window's edge) tile: the rows that
    see them get the reference's inf/NaN, the rows of the same tiles that do not stay finite (a
    weight of 0 counts 0, which the tensor cores' 0 x inf = NaN breaks without the exact rerun)."""
    arrays = _inputs(dtype, *sizes)
    rng = np.random.default_rng()
    seq_k, head_dim = sizes[4], sizes[5]
    for value in (np.inf, -np.inf, np.nan):
        arrays["v"][0, 0, rng.integers(seq_k // 3, seq_k), rng.integers(head_dim)] = value
    call = _validation.prepare("forward", {name: arrays[name] for name in "qkv"}, options)
    with _launch.emulated():
        out, lse = CudaBackend().forward(call.problem, arrays["q"], arrays["k"], arrays["v"], call.extras)
    with np.errstate(all="ignore"):
        expected_out, expected_lse = _reference(arrays, options)[:2]
    results = (("out", out.astype(np.float64), expected_out), ("lse", lse.astype(np.float64), expected_lse))
    for name, got, want in results:
        for kind, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
            where = np.argwhere(test(got) != test(want))
            assert where.size == 0, f"{name}: {kind} pattern differs from the reference at {where[:5].tolist()}"
        finite = np.isfinite(want)
        assert relative_error(got[finite], want[finite]) <= FORWARD_TOLERANCE[dtype], name


@pytest.mark.parametrize(("dtype", "sizes", "options"), NONFINITE_FORWARDS)
def test_inf_and_nan_values_reach_only_the_rows_that_see_them(
    dtype: str, sizes: tuple[int, ...], options: AttentionOptions
) -> None:
    check_nonfinite_forward(dtype, sizes, options)


BACKWARDS = [
    ("float32", (1, 2, 1, 40, 50, 64), AttentionOptions(causal=True), False),
    ("float16", (1, 2, 1, 70, 90, 64), AttentionOptions(causal="bottom_right"), False),
    ("bfloat16", (1, 2, 2, 70, 90, 64), AttentionOptions(), True),
    ("float16", (1, 2, 1, 40, 50, 256), AttentionOptions(causal=True), False),
    ("bfloat16", (1, 1, 1, 30, 40, 256), AttentionOptions(), True),
    ("float32", (1, 1, 1, 20, 40, 256), AttentionOptions(causal=True), False),
    # interior tiles of both backward kernels (no masking) between edge tiles, per head of a GQA
    # group (dK/dV walk each head's query tiles), with and without softcap
    ("float16", (1, 4, 2, 300, 300, 64), AttentionOptions(causal=True), False),
    ("bfloat16", (1, 4, 2, 300, 300, 64), AttentionOptions(causal="bottom_right"), True),
    ("bfloat16", (1, 2, 1, 200, 256, 128), AttentionOptions(window=(100, 20), softcap=3.0), True),
    ("float16", (2, 4, 1, 130, 200, 32), AttentionOptions(), True),
    ("float16", (1, 2, 1, 130, 100, 96), AttentionOptions(softcap=4.0), True),
    ("bfloat16", (1, 2, 2, 100, 100, 256), AttentionOptions(causal="bottom_right"), False),
]


@pytest.mark.parametrize(("dtype", "sizes", "options", "deterministic"), BACKWARDS)
def test_backward_kernels_match_the_reference(
    dtype: str, sizes: tuple[int, ...], options: AttentionOptions, deterministic: bool
) -> None:
    arrays = _inputs(dtype, *sizes)
    expected = _reference(arrays, options)
    out = expected[0].astype(DTYPES[dtype])
    lse = expected[1].astype(np.float32)
    named = {"q": arrays["q"], "k": arrays["k"], "v": arrays["v"], "dout": arrays["dout"], "out": out, "lse": lse}
    call = _validation.prepare("backward", named, options, deterministic=deterministic)
    backend = CudaBackend()
    with _launch.emulated():
        assert backend.not_supported_reasons(call.problem) == []
        grads = backend.backward(
            call.problem, arrays["dout"], arrays["q"], arrays["k"], arrays["v"], out, lse, call.extras
        )
    for grad, want, name in zip(grads, expected[2:], ("dq", "dk", "dv")):
        error = relative_error(grad.astype(np.float64), want)
        assert error <= BACKWARD_TOLERANCE[dtype], f"{name}: {error:.3g}"


def test_float32_softcap_gradient_where_tanh_saturates() -> None:
    """Scores near 6 softcaps, where 1 - tanh^2 keeps no correct digit in float32 (the float32
    kernels' derivative before issue #19: dq was 1e-2 off); inputs correlated so every score is there."""
    rng = np.random.default_rng()
    shape = (1, 2, 40, 64)
    q, k = ((1 + 0.2 * rng.standard_normal(shape)).astype(np.float32) for _ in range(2))
    v, dout = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    arrays = {"q": q, "k": k, "v": v, "dout": dout}
    options = AttentionOptions(softcap=1.3)
    expected = _reference(arrays, options)
    out, lse = expected[0].astype(np.float32), expected[1].astype(np.float32)
    call = _validation.prepare("backward", {**arrays, "out": out, "lse": lse}, options)
    with _launch.emulated():
        grads = CudaBackend().backward(call.problem, dout, q, k, v, out, lse, call.extras)
    for grad, want, name in zip(grads, expected[2:], ("dq", "dk", "dv")):
        error = relative_error(grad.astype(np.float64), want)
        assert error <= BACKWARD_TOLERANCE["float32"], f"{name}: {error:.3g}"


def test_inputs_off_16_byte_alignment_are_copied_for_the_tensor_core_kernels() -> None:
    """A view starting one element into its buffer: strides fine, base address not 16-byte aligned,
    which cp.async faults on (the emulator raises); the backend copies such inputs."""
    arrays = _inputs("float16", 1, 2, 1, 40, 50, 64)
    buffer = np.empty(arrays["q"].size + 1, np.float16)
    shifted = buffer[1:].reshape(arrays["q"].shape)
    shifted[...] = arrays["q"]
    assert shifted.ctypes.data % 16 != 0
    arrays["q"] = shifted
    options = AttentionOptions(causal=True)
    call = _validation.prepare("forward", {name: arrays[name] for name in "qkv"}, options)
    with _launch.emulated():
        out, _ = CudaBackend().forward(call.problem, shifted, arrays["k"], arrays["v"], call.extras)
    assert relative_error(out.astype(np.float64), _reference(arrays, options)[0]) <= FORWARD_TOLERANCE["float16"]
