"""The CUDA kernel sources and the kernel table, checked without a GPU (CuPy not needed).

What NVRTC is given (headers pasted in), that every kernel takes the one ``Params`` argument, that
CI's nvcc compile check instantiates every configuration the launchers can ask for (both come from
the table in ``fastattn/_gpu/ops.py``), and that every block fits the shared memory of sm_80.
(The launches themselves: tests/test_gpu_plans.py; Params' layout: tests/emulator/test_params.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fastattn._gpu import _launch, backward, decode, fp32, ops

from .test_gpu_plans import problem

#: The most dynamic shared memory one block may opt into on sm_80 (A100); sm_90 grants 227 KiB.
SM80_SHARED_BYTES = 163 * 1024
SOURCES = sorted({op.source for op in ops.OPS})
_KERNEL = re.compile(r"__global__ void (?:__launch_bounds__\([^)]*\)\s+)?(\w+)\(([^)]*)\)")


@pytest.mark.parametrize("filename", SOURCES)
def test_source_has_its_headers_pasted_in_once(filename: str) -> None:
    """common.cuh (with philox.h and ptx.cuh) in every source, each header once."""
    text = _launch.source_text(filename)
    assert not re.search(r'^#include "', text, re.MULTILINE)
    assert text.count("struct Params {") == 1 and text.count("struct Visibility {") == 1
    assert text.count("void philox4x32_10(") == 1
    assert "#include <cuda_fp16.h>" in text and "#include <cmath>" not in text


@pytest.mark.parametrize("filename", SOURCES)
def test_every_kernel_takes_one_params_argument(filename: str) -> None:
    kernels = _KERNEL.findall((_launch.KERNELS / filename).read_text())
    assert kernels
    for name, parameters in kernels:
        assert parameters == "const __grid_constant__ Params p", f"{name}({parameters})"


@pytest.mark.parametrize("filename", SOURCES)
def test_ci_instantiates_every_configuration_of_the_table(filename: str) -> None:
    unit = ops.instantiation_unit(filename)
    for op in ops.OPS:
        if op.source == filename:
            for name in op.all_instances():
                assert "<" not in name or f"template __global__ void {name}(" in unit


def test_ci_compiles_the_tables_instantiations() -> None:
    script = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert "python -m fastattn._gpu.instantiate" in script


def _problems() -> list:
    """Problems across the options the launchers choose by: dtype, head dims, Sq, dropout, determinism."""
    cases = []
    for dtype in ("float16", "bfloat16", "float32"):
        for head_dim in (16, 32, 64, 96, 128, 256):
            for seq_q in (1, 16, 100):
                for dropout_p in (0.0, 0.1):
                    for direction, deterministic in (("forward", False), ("backward", False), ("backward", True)):
                        cases.append(
                            problem(
                                dtype=dtype, head_dim=head_dim, head_dim_v=head_dim, seq_q=seq_q,
                                dropout_p=dropout_p, direction=direction, deterministic=deterministic,
                                q_strides=(seq_q * head_dim * 32, seq_q * head_dim, head_dim, 1),
                                k_strides=(4096 * head_dim * 8, 4096 * head_dim, head_dim, 1),
                                v_strides=(4096 * head_dim * 8, 4096 * head_dim, head_dim, 1),
                            )
                        )  # fmt: skip
    return cases


def test_every_kernel_a_call_can_run_is_in_the_table() -> None:
    """Whatever the problem, the instances the table names for it are among those CI compiles."""
    compiled = {name for op in ops.OPS for name in op.all_instances()}
    with _launch.emulated():
        for case in _problems():
            op = ops.select(case)
            if op is None:
                assert ops.reasons(case)
                continue
            assert set(op.instances(case)) <= compiled, case


def test_dropout_takes_the_general_forward_and_float64_is_declined() -> None:
    with _launch.emulated():
        assert ops.select(problem()).name == "flash_decode"
        assert ops.select(problem(dropout_p=0.1)).name == "flash_forward"
        assert ops.kernel_names(problem(dropout_p=0.1))[0].endswith(", true>")
        assert ops.select(problem(dtype="float32", dropout_p=0.1)).name == "fp32_forward"
        assert ops.reasons(problem(dtype="float64")) == ["float64 runs on the reference backend through CuPy"]
        (reason,) = ops.reasons(problem(head_dim=48, head_dim_v=48, seq_q=100))
        assert reason == "flash_forward: takes head_dim in (32, 64, 96, 128, 256), not 48"


def test_every_block_of_the_table_fits_sm80_shared_memory() -> None:
    with _launch.emulated():
        for case in _problems():
            op = ops.select(case)
            if op is not None:
                assert op.shared_bytes(case) <= SM80_SHARED_BYTES, (op.name, case)


@pytest.mark.parametrize("head_dim", backward.HEAD_DIMS)
def test_backward_kernel_names(head_dim: int) -> None:
    prepare, kv, convert = backward.kernel_names("bfloat16", head_dim, deterministic=False, dropout=False)
    assert prepare == f"fastattn_gpu::flash_backward_prepare<__nv_bfloat16, {head_dim}>"
    assert kv.endswith(", true, false, false>") and convert == "fastattn_gpu::flash_backward_dq_convert<__nv_bfloat16>"
    _, kv, dq = backward.kernel_names("float16", head_dim, deterministic=True, dropout=True)
    assert kv.endswith(", false, false, true>") and dq.startswith("fastattn_gpu::flash_backward_dq<__half,")
    assert dq.endswith(", false, true>")
    _, kv, dq = backward.kernel_names("float16", head_dim, deterministic=True, dropout=False, softcap=True)
    assert kv.endswith(", false, true, false>") and dq.endswith(", true, false>")


def test_misaligned_kv_leave_the_decode_kernel_to_the_general_forward() -> None:
    buffer = np.zeros(64 * 4 + 16, np.float16)
    first = (-buffer.ctypes.data % 16) // 2  # the first element on a 16-byte boundary
    k = buffer[first : first + 256].reshape(1, 1, 4, 64)
    shifted = buffer[first + 1 : first + 257].reshape(1, 1, 4, 64)
    case = problem(seq_k=4, batch=1, heads_kv=1, heads_q=1, head_dim=64, head_dim_v=64, dtype="float16")
    with _launch.emulated():
        assert ops.for_arrays(case, k, k, k).name == "flash_decode"
        assert ops.for_arrays(case, k, shifted, k).name == "flash_forward"


def test_decode_and_fp32_tables_cover_their_buckets() -> None:
    # float16/bfloat16 x softcap; float32 x 4 or 8 rows x walk or rerun; a combine per dtype
    assert len(decode.all_instances()) == 2 * len(decode.HEAD_DIMS) * 2 + len(decode.HEAD_DIMS) * 2 * 2 + 3
    assert len(fp32.all_forward_instances()) == 2 * len(fp32.BUCKETS) * 2
