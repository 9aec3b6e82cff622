"""GPU attention dropout, run by the SIMT emulator: the kernels' Philox masks equal the CPU's and the
reference's bit for bit, and their gradients match the float64 reference under the same mask.

The conformance suite's dropout tests reach the float32 kernels only (they draw float32/float64);
here the tensor-core kernels are held to the same rule, element by element: with V = identity the
output row *is* the dropped, rescaled probability row.
"""

from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _arrays

from ..conformance._cases import BACKWARD_TOLERANCE, FORWARD_TOLERANCE, relative_error

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": _arrays.bfloat16}
OPTIONS = [{}, {"causal": "bottom_right"}, {"window": (9, 4), "key_lengths": np.array([50, 23])}]


def _dropout() -> dict[str, object]:
    rng = np.random.default_rng()
    return {
        "dropout_p": 0.3,
        "dropout_seed": int(rng.integers(2**64, dtype=np.uint64)),
        "dropout_offset": int(rng.integers(2**32)),
    }


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seq_q", [70, 5], ids=["tiles", "decode-sized"])
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "causal", "window-lengths"])
def test_forward_mask_is_the_cpus_element_by_element(dtype: str, seq_q: int, options: dict) -> None:
    """Two query blocks (or a decode-sized call, which the decode kernel declines under dropout)
    over 64 keys, GQA 2; D = Dv = 64 so the tensor-core kernel takes it."""
    rng = np.random.default_rng()
    batch, heads_q, heads_kv, seq_k = 2, 4, 2, 64
    q = (0.2 * rng.standard_normal((batch, heads_q, seq_q, 64))).astype(DTYPES[dtype])
    k = rng.standard_normal((batch, heads_kv, seq_k, 64)).astype(DTYPES[dtype])
    v = np.broadcast_to(np.eye(seq_k, dtype=DTYPES[dtype]), (batch, heads_kv, seq_k, seq_k)).copy()
    drop = _dropout()
    explanation = fastattn.explain(q, k, v, backend="cuda-emulated", **options, **drop)
    kernel = explanation.kernels[0]
    flags = kernel[kernel.index("<") + 1 : -1].split(", ")
    dropout = flags[1] if kernel.startswith("fastattn_gpu::fp32_forward") else flags[-1]
    assert dropout == "true", explanation.kernels
    got = fastattn.attention(q, k, v, backend="cuda-emulated", **options, **drop).astype(np.float64)
    cpu = fastattn.attention(q, k, v, backend="cpu", **options, **drop).astype(np.float64)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    want = fastattn.attention(*wide, backend="reference", **options, **drop)
    assert np.array_equal(got == 0, want == 0), f"dropped elements differ from the reference ({drop})"
    assert np.array_equal(got == 0, cpu == 0), f"dropped elements differ from the CPU's ({drop})"
    assert relative_error(got, want) <= FORWARD_TOLERANCE[dtype]


BACKWARDS = [
    ("float16", False, {"causal": True}),
    ("float16", True, {"window": (20, 5)}),
    ("bfloat16", False, {"key_lengths": np.array([40, 90])}),
    ("bfloat16", True, {"softcap": 4.0}),
    ("float32", True, {"causal": "bottom_right"}),
    ("float32", True, {}),
]


@pytest.mark.parametrize(("dtype", "deterministic", "options"), BACKWARDS)
def test_backward_matches_the_reference_under_the_same_mask(dtype: str, deterministic: bool, options: dict) -> None:
    """dq, dk, dv of the tensor-core kernels (atomic and deterministic dQ) and of the float32
    kernels against the float64 reference with the same seed; GQA 2, partial tiles."""
    rng = np.random.default_rng()
    batch, heads_q, heads_kv, seq_q, seq_k, dim = 2, 4, 2, 70, 90, 64
    shapes = {"q": (batch, heads_q, seq_q, dim), "k": (batch, heads_kv, seq_k, dim), "v": (batch, heads_kv, seq_k, dim)}
    arrays = {name: rng.standard_normal(shape).astype(DTYPES[dtype]) for name, shape in shapes.items()}
    dout = rng.standard_normal(shapes["q"]).astype(DTYPES[dtype])
    drop = _dropout()
    wide = {name: array.astype(np.float64) for name, array in arrays.items()}
    out, lse = fastattn.attention(**wide, backend="reference", return_lse=True, **options, **drop)
    want = fastattn.attention_backward(dout.astype(np.float64), **wide, out=out, lse=lse, backend="reference",
                                       **options, **drop)  # fmt: skip
    explanation = fastattn.explain(*arrays.values(), backend="cuda-emulated", **options, **drop)
    assert explanation.backward_kernels[1].endswith(", true>"), explanation.backward_kernels  # the kv kernel
    got = fastattn.attention_backward(
        dout, **arrays, out=out.astype(DTYPES[dtype]), lse=lse.astype(np.float32), backend="cuda-emulated",
        deterministic=deterministic, **options, **drop,
    )  # fmt: skip
    for grad, expected, name in zip(got, want, ("dq", "dk", "dv")):
        error = relative_error(grad.astype(np.float64), expected)
        assert error <= BACKWARD_TOLERANCE[dtype], f"{name}: {error:.3g} ({drop})"
