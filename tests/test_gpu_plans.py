"""Host-side logic of the GPU launchers (issue #13), checked without a GPU or CuPy.

Decode dispatch and split plan, shared-memory sizes within what every target GPU grants a block,
the float32/float64 refusals of the cuda backend, and the header inlining that NVRTC relies on.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from fastattn._gpu import _launch, decode, fp32
from fastattn._problem import AttentionProblem
from fastattn.backends.cuda import CudaBackend

#: The smallest opt-in shared memory per block of the targets (A100, sm_80: 163 KiB).
SHARED_LIMIT = 163 * 1024


def problem(**changes) -> AttentionProblem:
    """G7 (B=32, Hq=32, Hkv=8, Sq=1, Sk=4096, D=128), bfloat16, bottom-right; fields overridable."""
    base = AttentionProblem(
        direction="forward", framework="cupy", device="cuda", dtype="bfloat16", batch=32, heads_q=32, heads_kv=8,
        seq_q=1, seq_k=4096, head_dim=128, head_dim_v=128, layout="bhsd", scale=128**-0.5, causal="bottom_right",
        window=None, softcap=None, mask=None, mask_shape=None, mask_dtype=None, has_key_lengths=False,
        q_strides=(4096, 128, 128, 1), k_strides=(4096 * 1024, 4096 * 128, 128, 1),
        v_strides=(4096 * 1024, 4096 * 128, 128, 1),
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_decode_takes_the_kv_cache_step() -> None:
    assert decode.eligible(problem())
    assert decode.eligible(problem(dtype="float32", seq_q=16))
    assert not decode.eligible(problem(seq_q=17))
    assert not decode.eligible(problem(head_dim=96, head_dim_v=96))
    assert not decode.eligible(problem(head_dim_v=64))
    assert not decode.eligible(problem(dtype="float64"))
    assert not decode.eligible(problem(direction="backward"))
    assert not decode.eligible(problem(dtype="float32", k_strides=(4096 * 130, 4096 * 130, 130, 1)))
    assert not decode.eligible(problem(mask="float", mask_shape=(1, 1, 1, 4096), mask_dtype="float64"))


@pytest.mark.parametrize("seq_k", [1, 7, 63, 64, 65, 257, 4095, 4096, 4097, 100_000])
@pytest.mark.parametrize("batch, heads_kv, group, seq_q", [(32, 8, 4, 1), (1, 1, 1, 1), (1, 8, 8, 16), (200, 8, 1, 1)])
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float32", 128), ("float16", 256)])
def test_split_plan_covers_every_key_once(seq_k, batch, heads_kv, group, seq_q, dtype, head_dim) -> None:
    case = problem(
        seq_k=seq_k, batch=batch, heads_kv=heads_kv, heads_q=heads_kv * group, seq_q=seq_q, dtype=dtype,
        head_dim=head_dim, head_dim_v=head_dim,
    )  # fmt: skip
    splits, per_split = decode.plan(case, multiprocessors=132)
    tile = decode.block_keys(dtype, head_dim)
    assert per_split % tile == 0
    assert (splits - 1) * per_split < seq_k <= splits * per_split, "no empty trailing split, no key left out"
    assert splits <= max(1, math.ceil(seq_k / decode.MIN_KEYS_PER_SPLIT))


def test_split_plan_of_g7_and_of_a_single_long_sequence() -> None:
    assert decode.plan(problem(), multiprocessors=132) == (3, 1408)
    assert decode.plan(problem(batch=1, seq_k=32768), multiprocessors=132)[0] == 64


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("head_dim", decode.HEAD_DIMS)
@pytest.mark.parametrize("rows", [4, 8])
def test_decode_shared_memory_fits_every_target(dtype, head_dim, rows) -> None:
    assert decode.shared_bytes(dtype, head_dim, rows) <= SHARED_LIMIT


@pytest.mark.parametrize("dmax", fp32.BUCKETS)
def test_fp32_shared_memory_fits_every_target(dmax) -> None:
    for size in (fp32.forward_shared_bytes(dmax), fp32.kv_shared_bytes(dmax), fp32.q_shared_bytes(dmax)):
        assert size <= SHARED_LIMIT


def test_fp32_bucket_covers_both_head_dims() -> None:
    assert fp32.bucket(problem(dtype="float32", head_dim=80, head_dim_v=24)) == 128
    assert fp32.bucket(problem(dtype="float32", head_dim=16, head_dim_v=48)) == 64
    assert fp32.bucket(problem(dtype="float32", head_dim=256, head_dim_v=8)) == 256


def test_cuda_reasons_for_float32_and_float64() -> None:
    cuda = CudaBackend()
    assert cuda.not_supported_reasons(problem(dtype="float32", head_dim=80, head_dim_v=24)) == []
    assert cuda.not_supported_reasons(problem(dtype="float32", direction="backward")) == []
    assert cuda.not_supported_reasons(problem(dtype="float64")) == [
        "float64 runs on the reference backend through CuPy"
    ]
    (reason,) = cuda.not_supported_reasons(problem(dtype="float32", head_dim=512, head_dim_v=512))
    assert "up to 256" in reason and "D=512" in reason


def test_sources_reach_nvrtc_with_their_headers_inlined() -> None:
    for source in (decode.SOURCE, fp32.SOURCE):
        text = _launch.source_text(source)
        assert '#include "' not in text
        assert "struct Visibility" in text
