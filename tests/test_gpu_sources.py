"""The tensor-core kernel sources and launchers, checked without a GPU (CuPy not needed).

What NVRTC is given (headers pasted in), that CI's nvcc compile check instantiates every
configuration the launchers can ask for, and that every block fits the shared memory of sm_80.
(Launch arguments against the kernels' parameter lists: tests/test_gpu_plans.py.)
"""

from __future__ import annotations

import re

import pytest

from fastattn._gpu import _launch
from fastattn._gpu import backward as gpu_backward
from fastattn._gpu import forward as gpu_forward

#: The most dynamic shared memory one block may opt into on sm_80 (A100); sm_90 grants 227 KiB.
SM80_SHARED_BYTES = 163 * 1024
ELEMENTS = ("__half", "__nv_bfloat16")


@pytest.mark.parametrize("filename", [gpu_forward.SOURCE, gpu_backward.SOURCE])
def test_source_has_its_headers_pasted_in_once(filename: str) -> None:
    """flash_common.cuh includes decode_common.cuh: both expanded, each once."""
    text = _launch.source_text(filename)
    assert not re.search(r'^#include "', text, re.MULTILINE)
    assert text.count("struct ScoreRule") == 1 and text.count("struct Visibility") == 1
    assert "#include <cuda_fp16.h>" in text and "#include <cmath>" not in text


def _instantiated(filename: str) -> str:
    text = (_launch.KERNELS / filename).read_text()
    return text[text.index("#ifdef FASTATTN_INSTANTIATE") :]


@pytest.mark.parametrize("head_dim", gpu_forward.HEAD_DIMS)
def test_ci_instantiates_every_forward_configuration(head_dim: int) -> None:
    block = _instantiated("flash_forward.cu")
    for element in ELEMENTS:
        assert f"FASTATTN_FORWARD({element}, {head_dim}, {gpu_forward.block_keys(head_dim)})" in block


@pytest.mark.parametrize("head_dim", gpu_backward.HEAD_DIMS)
def test_ci_instantiates_every_backward_configuration(head_dim: int) -> None:
    block = _instantiated("flash_backward.cu")
    block_m, key_warps = gpu_backward.backward_tiles(head_dim)
    dq_keys = gpu_backward.dq_block_keys(head_dim)
    assert f"FASTATTN_CONFIG(ELEM, {head_dim}, {block_m}, {key_warps}, {dq_keys})" in block
    assert "FASTATTN_CONFIGS(__half)" in block and "FASTATTN_CONFIGS(__nv_bfloat16)" in block


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", gpu_backward.HEAD_DIMS)
def test_backward_blocks_fit_sm80_shared_memory(head_dim: int, deterministic: bool) -> None:
    assert gpu_backward.shared_bytes(head_dim, deterministic) <= SM80_SHARED_BYTES
    assert gpu_forward.shared_bytes(head_dim) <= SM80_SHARED_BYTES


@pytest.mark.parametrize("head_dim", gpu_backward.HEAD_DIMS)
def test_backward_kernel_names(head_dim: int) -> None:
    prepare, kv, convert = gpu_backward.kernel_names("bfloat16", head_dim, deterministic=False)
    assert prepare == f"fastattn_gpu::flash_backward_prepare<__nv_bfloat16, {head_dim}>"
    assert kv.endswith(", true>") and convert == "fastattn_gpu::flash_backward_dq_convert<__nv_bfloat16>"
    _, kv, dq = gpu_backward.kernel_names("float16", head_dim, deterministic=True)
    assert kv.endswith(", false>") and dq.startswith("fastattn_gpu::flash_backward_dq<__half,")
