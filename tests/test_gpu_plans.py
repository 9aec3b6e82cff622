"""Host-side logic of the GPU launchers (issue #13), checked without a GPU or CuPy.

Decode dispatch and split plan, shared-memory sizes within what every target GPU grants a block,
the float32/float64 refusals of the cuda backend, the header inlining that NVRTC relies on, and the
launches themselves (each passes the call's one Params record, pointing at the call's arrays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import types

import numpy as np
import pytest

from fastattn._gpu import _launch, backward, decode, forward, fp32, ops, params
from fastattn._problem import AttentionExtras, AttentionProblem
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
    changed = dataclasses.replace(base, **changes)
    if "key_offset" in changes:
        return changed
    bottom_right = changed.causal == "bottom_right"
    return dataclasses.replace(changed, key_offset=changed.seq_k - changed.seq_q if bottom_right else 0)


def _runs_decode(case: AttentionProblem) -> bool:
    with _launch.emulated():  # the device facts of an H100 (the backward's shared memory)
        op = ops.select(case)
    return op is not None and op.name == "flash_decode"


def test_decode_takes_the_kv_cache_step() -> None:
    assert _runs_decode(problem())
    assert _runs_decode(problem(dtype="float32", seq_q=16))
    assert not _runs_decode(problem(seq_q=17))
    assert not _runs_decode(problem(head_dim=96, head_dim_v=96))
    assert not _runs_decode(problem(head_dim_v=64))
    assert not _runs_decode(problem(dtype="float64"))
    assert not _runs_decode(problem(direction="backward"))
    assert not _runs_decode(problem(dtype="float32", k_strides=(4096 * 130, 4096 * 130, 130, 1)))
    assert not _runs_decode(problem(mask="float", mask_shape=(1, 1, 1, 4096), mask_dtype="float64"))
    assert not _runs_decode(problem(dropout_p=0.1))


@pytest.mark.parametrize("seq_k", [1, 7, 63, 64, 65, 257, 4095, 4096, 4097, 100_000])
@pytest.mark.parametrize("batch, heads_kv, group, seq_q", [(32, 8, 4, 1), (1, 1, 1, 1), (1, 8, 8, 16), (200, 8, 1, 1)])
@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 128), ("float32", 128), ("float16", 256)])
def test_split_plan_covers_every_key_once(seq_k, batch, heads_kv, group, seq_q, dtype, head_dim) -> None:
    case = problem(
        seq_k=seq_k, batch=batch, heads_kv=heads_kv, heads_q=heads_kv * group, seq_q=seq_q, dtype=dtype,
        head_dim=head_dim, head_dim_v=head_dim,
    )  # fmt: skip
    splits, per_split = decode.plan(case, multiprocessors=132)
    tile = decode.block_keys(dtype, head_dim, decode.rows_per_block(case))
    assert per_split % tile == 0
    assert (splits - 1) * per_split < seq_k <= splits * per_split, "no empty trailing split, no key left out"
    assert splits <= max(1, math.ceil(seq_k / decode.MIN_KEYS_PER_SPLIT))


def test_split_plan_of_g7_and_of_a_single_long_sequence() -> None:
    assert decode.plan(problem(), multiprocessors=132) == (3, 1408)
    assert decode.plan(problem(batch=1, seq_k=32768), multiprocessors=132)[0] == 64


@pytest.mark.parametrize(("dtype", "rows"), [("float16", 16), ("bfloat16", 16), ("float32", 4), ("float32", 8)])
@pytest.mark.parametrize("head_dim", decode.HEAD_DIMS)
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
    for source in (decode.SOURCE, fp32.SOURCE, forward.SOURCE, backward.SOURCE):
        text = _launch.source_text(source)
        assert '#include "' not in text
        assert "struct Visibility" in text


# Launches, recorded by a stand-in for CuPy: each passes one Params record.


def _record(arguments: tuple) -> np.void:
    (record,) = arguments
    assert isinstance(record, np.void) and record.dtype == params.PARAMS
    return record


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple, tuple, int, tuple]]:
    """Replace CuPy by a recorder; each launch is checked against its kernel's parameter list."""
    recorded: list[tuple[str, tuple, tuple, int, tuple]] = []

    class Function:
        def __init__(self, name: str) -> None:
            self.name = name
            self.max_dynamic_shared_size_bytes = 0

        def __call__(self, grid: tuple, block: tuple, arguments: tuple, shared_mem: int = 0) -> None:
            _record(arguments)
            assert shared_mem <= max(self.max_dynamic_shared_size_bytes, 48 * 1024)
            x, y, z = (*grid, 1, 1)[:3]
            assert 0 < x < 2**31 and 0 < y < 65536 and 0 < z < 65536
            recorded.append((self.name, grid, block, shared_mem, arguments))

    class Module:
        def __init__(self, code: str, options: tuple, name_expressions: tuple) -> None:
            assert '#include "' not in code

        def get_function(self, name: str) -> Function:
            return Function(name)

    device = types.SimpleNamespace(id=0, attributes={"MultiProcessorCount": 132})
    fake = types.SimpleNamespace(
        RawModule=Module, empty=np.empty, float32=np.float32, ascontiguousarray=np.ascontiguousarray,
        cuda=types.SimpleNamespace(get_current_stream=contextlib.nullcontext, Device=lambda *index: device),
    )  # fmt: skip
    monkeypatch.setitem(sys.modules, "cupy", fake)
    _launch._device_kernel.cache_clear()
    _launch._multiprocessors.cache_clear()
    yield recorded
    _launch._device_kernel.cache_clear()
    _launch._multiprocessors.cache_clear()


def _arrays_for(case: AttentionProblem, dtype: type = np.float32) -> dict[str, np.ndarray]:
    shapes = {
        "q": (case.batch, case.heads_q, case.seq_q, case.head_dim),
        "k": (case.batch, case.heads_kv, case.seq_k, case.head_dim),
        "v": (case.batch, case.heads_kv, case.seq_k, case.head_dim_v),
        "out": (case.batch, case.heads_q, case.seq_q, case.head_dim_v),
    }
    arrays = {name: np.zeros(shape, dtype) for name, shape in shapes.items()}
    arrays["lse"] = np.zeros(shapes["q"][:3], np.float32)
    return arrays


@pytest.mark.parametrize("seq_k", [63, 4096])
@pytest.mark.parametrize("mask", [False, True])
def test_decode_launch_arguments_match_the_kernel(launches, seq_k, mask) -> None:
    case = problem(dtype="float32", seq_k=seq_k, batch=2, has_key_lengths=True)
    a = _arrays_for(case)
    extras = AttentionExtras(
        mask=np.ones((1, 1, 1, seq_k), bool) if mask else None, key_lengths=np.full(2, seq_k, np.int64)
    )
    decode.forward(case, a["q"], a["k"], a["v"], a["out"], a["lse"], extras)
    names = [launch[0] for launch in launches]
    splits = decode.plan(case, 132)[0]
    assert names[:2] == [f"fastattn_gpu::flash_decode_fp32<128, 4, {rerun}>" for rerun in ("false", "true")]
    assert launches[0][1] == launches[1][1] == (splits, case.heads_kv, case.batch)
    assert names[2:] == (["fastattn_gpu::decode_combine<float>"] if splits > 1 else [])


def test_fp32_launch_arguments_match_the_kernels(launches) -> None:
    case = problem(dtype="float32", seq_q=100, seq_k=130, head_dim=80, head_dim_v=24, causal=None, window=(5, 7))
    a = _arrays_for(case)
    extras = AttentionExtras()
    fp32.forward(case, a["q"], a["k"], a["v"], a["out"], a["lse"], extras)
    fp32.backward(case, a["out"], a["q"], a["k"], a["v"], a["out"], a["lse"], extras)
    assert [launch[0] for launch in launches] == [
        "fastattn_gpu::fp32_forward<128, false, false>",
        "fastattn_gpu::fp32_forward<128, false, true>",
        "fastattn_gpu::fp32_delta",
        "fastattn_gpu::fp32_backward_kv<128, false>",
        "fastattn_gpu::fp32_backward_q<128, false>",
    ]
    assert launches[0][1] == launches[1][1] == (2, 32, 32)
    assert launches[3][1] == (3, 8, 32) and launches[4][1] == (2, 32, 32)
    assert _record(launches[1][4]) == _record(launches[0][4]), "the rerun takes the walk's record"
    forward_record, backward_record = _record(launches[0][4]), _record(launches[2][4])
    for name in ("q", "k", "v", "out", "lse"):
        assert forward_record[name]["data"] == a[name].ctypes.data
        assert tuple(forward_record[name][["sb", "sh", "ss"]].item()) == tuple(
            stride // a[name].itemsize for stride in a[name].strides[:3]
        )
    assert forward_record["rules"]["window_left"] == 5 and forward_record["rules"]["window_right"] == 7
    assert forward_record["head_dim"] == 80 and forward_record["head_dim_v"] == 24
    assert all(backward_record[name]["data"] != 0 for name in ("dq", "dk", "dv", "dout"))
    assert backward_record["delta"] != 0
    assert all(_record(launch[4]) == backward_record for launch in launches[3:]), "one record per call"


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", backward.HEAD_DIMS)
def test_tensor_core_launch_arguments_match_the_kernels(launches, head_dim: int, deterministic: bool) -> None:
    """Forward, then the half-precision backward (issue #12): delta pre-pass, kv kernel, dQ."""
    case = problem(
        dtype="float16", seq_q=100, seq_k=130, head_dim=head_dim, head_dim_v=head_dim, window=(5, 7),
        has_key_lengths=True, mask="bool", mask_shape=(1, 1, 100, 130), mask_dtype="bool", deterministic=deterministic,
    )  # fmt: skip
    a = _arrays_for(case, np.float16)
    extras = AttentionExtras(mask=np.ones((1, 1, 100, 130), bool), key_lengths=np.full(32, 130, np.int64))
    forward.forward(case, a["q"], a["k"], a["v"], a["out"], a["lse"], extras)
    arrays = {name: a[name] for name in ("q", "k", "v", "out", "lse")}
    grads = (np.empty_like(a["q"]), np.empty_like(a["k"]), np.empty_like(a["v"]))
    backward.backward(case, {**arrays, "dout": a["out"]}, grads, extras)
    names = [launch[0].split("::")[1].split("<")[0] for launch in launches]
    last = "flash_backward_dq" if deterministic else "flash_backward_dq_convert"
    assert names == ["flash_forward", "flash_backward_prepare", "flash_backward_kv", last]
    kv = launches[2]
    assert kv[1] == (math.ceil(130 / backward.block_keys(head_dim)), case.heads_kv, case.batch)
    assert kv[2] == (backward.KV_WARPS * 32,) and kv[3] == backward.kv_shared_bytes(head_dim)
