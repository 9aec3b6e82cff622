"""What every kernel launcher shares: compiling a source through NVRTC, streams, argument lists.

Sources live in ``kernels/``.  A local ``#include "name.cuh"`` is replaced by that header's text
before NVRTC sees the source, because CuPy's on-disk kernel cache is keyed on the source string and
options only: a header found through ``-I`` could change without invalidating the cached binary.
nvcc (CI's compile check) reads the same headers through the ``#include``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from .._problem import AttentionExtras, AttentionProblem

KERNELS = Path(__file__).with_name("kernels")
#: Float mask dtypes the kernels read, and the MaskKind code each is passed as (bool is 1).
MASK_KINDS = {"bool": 1, "float32": 2, "float16": 3, "bfloat16": 4}
#: C++ element type of each input dtype the tensor-core kernels take.
ELEMENTS = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def source(filename: str) -> str:
    """The text of ``kernels/<filename>`` with its local ``#include "x.cuh"`` lines expanded.

    Parameters
    ----------
    filename : str
        A file in ``fastattn/_gpu/kernels``; headers it includes by quoted name are expanded in
        turn, each once (they carry include guards, so later copies would be empty anyway).
    """
    expanded: set[str] = set()

    def expand(name: str) -> str:
        if name in expanded:
            return ""
        expanded.add(name)
        return _LOCAL_INCLUDE.sub(lambda match: expand(match.group(1)), (KERNELS / name).read_text())

    return expand(filename)


def compile_functions(filename: str, names: tuple[str, ...], shared_bytes: tuple[int, ...]) -> tuple[Any, ...]:
    """Compile the template instances ``names`` of one source and return their kernels.

    Parameters
    ----------
    filename : str
        Source file in ``kernels/``.
    names : tuple of str
        Fully qualified template instances, e.g. ``"fastattn_gpu::flash_forward<__half, 64, 64>"``.
    shared_bytes : tuple of int
        Dynamic shared memory each kernel is launched with (0: none); above 48 KiB it must be
        granted to the function before the launch.

    Returns
    -------
    tuple of cupy.RawKernel
        One per name, in order.
    """
    cupy = importlib.import_module("cupy")
    module = cupy.RawModule(code=source(filename), options=("--std=c++17",), name_expressions=names)
    functions = []
    for name, size in zip(names, shared_bytes):
        function = module.get_function(name)
        if size:
            function.max_dynamic_shared_size_bytes = size
        functions.append(function)
    return tuple(functions)


def row_strides(array: Any) -> list[np.int64]:
    """Element strides of the batch, head and sequence axes of a ``(B, H, S, D)`` array."""
    return [np.int64(stride // array.itemsize) for stride in array.strides[:3]]


def stream(framework: str) -> Any:
    """The caller's current stream: torch's for torch tensors, else CuPy's."""
    cupy = importlib.import_module("cupy")
    if framework == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return cupy.cuda.get_current_stream()


def contract_arguments(problem: AttentionProblem, extras: AttentionExtras) -> list[Any]:
    """The kernels' common trailing arguments: sizes, scale, softcap, causal, window, mask, key_lengths.

    In order: ``seq_q, seq_k, group, scale, softcap, causal, offset, window_left, window_right,
    mask, mask_kind, m_sb, m_sh, m_sq, m_sk, key_lengths`` (int32, float32, pointers and int64
    element strides, 0 along a mask's broadcast axes; null pointers where absent).
    """
    left, right = problem.window if problem.window is not None else (-1, -1)
    mask = extras.mask
    null = np.uint64(0)
    if mask is None:
        mask_arguments = [null, np.int32(0)] + [np.int64(0)] * 4
    else:
        mask_strides = [0 if size == 1 else stride // mask.itemsize for size, stride in zip(mask.shape, mask.strides)]
        mask_arguments = [mask, np.int32(MASK_KINDS[mask.dtype.name])] + [np.int64(s) for s in mask_strides]
    return [
        np.int32(problem.seq_q), np.int32(problem.seq_k), np.int32(problem.group_size),
        np.float32(problem.scale), np.float32(problem.softcap or 0.0),
        np.int32(problem.causal is not None), np.int32(problem.key_offset),
        np.int32(left), np.int32(right),
        *mask_arguments,
        null if extras.key_lengths is None else extras.key_lengths,
    ]  # fmt: skip
