"""The GPU kernel sources and launchers, checked without a GPU (CuPy not needed).

What NVRTC is given (headers pasted in), that CI's nvcc compile check instantiates every
configuration the launchers can ask for, and that every block fits the shared memory of sm_80.
"""

from __future__ import annotations

import contextlib
import re
import sys
import types

import numpy as np
import pytest

from fastattn._gpu import _launch
from fastattn._gpu import backward as gpu_backward
from fastattn._gpu import forward as gpu_forward
from fastattn._validation import prepare

#: The most dynamic shared memory one block may opt into on sm_80 (A100); sm_90 grants 227 KiB.
SM80_SHARED_BYTES = 163 * 1024
ELEMENTS = ("__half", "__nv_bfloat16")


@pytest.mark.parametrize("filename", ["flash_forward.cu", "flash_backward.cu"])
def test_source_has_its_headers_pasted_in_once(filename: str) -> None:
    text = _launch.source(filename)
    assert not re.search(r'^#include "', text, re.MULTILINE)
    assert text.count("struct ScoreRule") == 1
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


# --------------------------------------------------------------------------------------------------
# The launchers' argument lists against the kernels' parameter lists (CuPy passes arguments as an
# untyped array: a missing or misplaced one would not be caught at launch).


def _parameter_kinds(filename: str, kernel: str) -> list[str]:
    text = (_launch.KERNELS / filename).read_text()
    match = re.search(rf"\b{kernel}\(([^)]*)\)\s*\{{", text)
    assert match, f"no definition of {kernel} in {filename}"
    kinds = []
    for parameter in match.group(1).split(","):
        parameter = " ".join(parameter.split())
        if "*" in parameter:
            kinds.append("pointer")
        elif parameter.startswith("long long"):
            kinds.append("int64")
        elif parameter.startswith("int "):
            kinds.append("int32")
        elif parameter.startswith("float "):
            kinds.append("float32")
        else:
            raise AssertionError(f"unexpected parameter {parameter!r} of {kernel}")
    return kinds


def _argument_kind(value: object) -> str:
    if isinstance(value, (np.ndarray, np.uint64)):
        return "pointer"
    return {np.int64: "int64", np.int32: "int32", np.float32: "float32"}[type(value)]


class _FakeKernel:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, arguments, shared_mem=0) -> None:
        assert shared_mem <= max(self.max_dynamic_shared_size_bytes, 48 * 1024), self.name
        self.calls.append((self.name, grid, block, arguments))


@pytest.fixture
def fake_cupy(monkeypatch):
    """A stand-in CuPy whose kernels record their launches; numpy arrays play device arrays."""
    calls: list = []

    class RawModule:
        def __init__(self, code, options, name_expressions) -> None:
            assert '#include "' not in code and options == ("--std=c++17",)
            self.names = name_expressions

        def get_function(self, name):
            assert name in self.names
            return _FakeKernel(name, calls)

    fake = types.SimpleNamespace(
        RawModule=RawModule,
        empty=lambda size, dtype: np.empty(size, dtype),
        float32=np.float32,
        cuda=types.SimpleNamespace(get_current_stream=contextlib.nullcontext),
    )
    monkeypatch.setitem(sys.modules, "cupy", fake)
    gpu_forward.kernel.cache_clear()
    gpu_backward.kernels.cache_clear()
    yield calls
    gpu_forward.kernel.cache_clear()
    gpu_backward.kernels.cache_clear()


def _kernel_name(launched: str) -> str:
    return launched.split("::")[1].split("<")[0]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("head_dim", gpu_backward.HEAD_DIMS)
def test_launch_arguments_match_kernel_parameters(fake_cupy, head_dim: int, deterministic: bool) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 70, head_dim)).astype(np.float16)
    k, v = (rng.standard_normal((2, 2, 90, head_dim)).astype(np.float16) for _ in "kv")
    options = {"causal": "bottom_right", "key_lengths": np.array([90, 40]), "mask": rng.random((70, 90)) < 0.5}
    out, lse = np.zeros_like(q), np.zeros((2, 4, 70), np.float32)
    forward = prepare("forward", {"q": q, "k": k, "v": v}, **options)
    gpu_forward.forward(forward.problem, q, k, v, out, lse, forward.extras)
    arrays = {"q": q, "k": k, "v": v, "dout": q.copy(), "out": out, "lse": lse}
    backward = prepare("backward", arrays, deterministic=deterministic, **options)
    grads = (np.empty_like(q), np.empty_like(k), np.empty_like(v))
    gpu_backward.backward(backward.problem, backward.arrays, grads, backward.extras)
    launched = [_kernel_name(name) for name, *_ in fake_cupy]
    last = "flash_backward_dq" if deterministic else "flash_backward_dq_convert"
    assert launched == ["flash_forward", "flash_backward_prepare", "flash_backward_kv", last]
    for name, grid, block, arguments in fake_cupy:
        filename = "flash_forward.cu" if _kernel_name(name) == "flash_forward" else "flash_backward.cu"
        assert [_argument_kind(a) for a in arguments] == _parameter_kinds(filename, _kernel_name(name)), name
        assert all(size >= 1 for size in grid) and len(block) == 1
    kv_block = next(block for name, _, block, _ in fake_cupy if "flash_backward_kv" in name)
    assert kv_block == (gpu_backward.KV_WARPS * 32,)
