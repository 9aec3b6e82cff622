"""What every GPU launcher needs: sources with their headers, compiled kernels, strides, streams.

Sources may ``#include "name.cuh"`` headers from ``kernels/``: :func:`source_text` inlines them,
so NVRTC needs no include path and CuPy's on-disk kernel cache keys on the whole text (an edited
header recompiles).  nvcc (CI's compile check) finds the same headers next to the sources.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from .._codes import MASK_CODES
from .._problem import AttentionExtras, AttentionProblem

KERNELS = Path(__file__).with_name("kernels")
#: The mask kinds the GPU kernels read, with their codes (``fastattn/_codes.py``; no float64 mask).
MASK_KINDS = {name: code for name, code in MASK_CODES.items() if name not in (None, "float64")}
#: C++ element type of each input dtype of the tensor-core kernels.
ELEMENTS = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.cuh)"$', re.MULTILINE)


def source_text(name: str) -> str:
    """The text of ``kernels/<name>`` with each local ``#include "x.cuh"`` replaced by the header.

    Headers that include headers are expanded in turn, each header once (they are ``#pragma once``
    anyway, and NVRTC, given no include path, could not find a second copy's include).
    """
    expanded: set[str] = set()

    def expand(file: str) -> str:
        if file in expanded:
            return ""
        expanded.add(file)
        return _INCLUDE.sub(lambda match: expand(match.group(1)), (KERNELS / file).read_text())

    return expand(name)


_EMULATED: contextvars.ContextVar[bool] = contextvars.ContextVar("fastattn_gpu_emulated", default=False)
#: Streaming multiprocessors the emulated device reports: an H100 SXM's, so that split plans and
#: grids are the ones an H100 gets (``FASTATTN_EMULATED_SMS`` sets another count).
EMULATED_MULTIPROCESSORS = 132
#: The most dynamic shared memory one block may opt into on the emulated device (an H100's).
EMULATED_SHARED_MEMORY_PER_BLOCK = 227 * 1024


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """Within the block, launch kernels on the SIMT emulator (``fastattn/_gpu/emulator``) with host
    numpy arrays standing in for device arrays, instead of on a GPU through CuPy."""
    token = _EMULATED.set(True)
    try:
        yield
    finally:
        _EMULATED.reset(token)


def is_emulated() -> bool:
    """Whether launches go to the SIMT emulator (inside :func:`emulated`)."""
    return _EMULATED.get()


def array_module() -> ModuleType:
    """The array module of device arrays: CuPy, or numpy on the emulator."""
    return np if _EMULATED.get() else importlib.import_module("cupy")


def address(array: Any) -> int:
    """The address of a device array's first element (a host address on the emulator)."""
    return int(array.ctypes.data) if isinstance(array, np.ndarray) else int(array.data.ptr)


def compiled(source: str, name: str, shared_bytes: int) -> Any:
    """The kernel ``name`` (a template instance) of ``kernels/<source>``, compiled once per process.

    Parameters
    ----------
    source : str
        File name under ``kernels/``.
    name : str
        Fully qualified name expression, e.g. ``"fastattn_gpu::fp32_forward<128>"``.
    shared_bytes : int
        Dynamic shared memory the launches will ask for (raises the 48 KiB default limit).

    Returns
    -------
    callable
        ``kernel(grid, block, args, shared_mem=...)``: a CuPy ``RawKernel``, or the emulator's
        kernel inside :func:`emulated`.
    """
    if _EMULATED.get():
        return _emulated_kernel(source, name)
    return _device_kernel(source, name, shared_bytes)


@functools.cache
def _emulated_kernel(source: str, name: str) -> Any:
    from . import emulator

    return emulator.compile_source(source_text(source), (name,)).get_function(name)


@functools.cache
def _device_kernel(source: str, name: str, shared_bytes: int) -> Any:
    cupy = importlib.import_module("cupy")
    module = cupy.RawModule(code=source_text(source), options=("--std=c++17",), name_expressions=(name,))
    function = module.get_function(name)
    if shared_bytes > 0:
        function.max_dynamic_shared_size_bytes = shared_bytes
    return function


def strides3(array: Any) -> list[np.int64]:
    """Element strides of the first three axes of a ``(B, H, S, D)`` array, as kernel arguments."""
    return [np.int64(stride // array.itemsize) for stride in array.strides[:3]]


def strides2(array: Any) -> list[np.int64]:
    """Element strides of the first two axes of a ``(B, H, S)`` lse array (its last axis contiguous)."""
    return [np.int64(stride // array.itemsize) for stride in array.strides[:2]]


def stream(framework: str) -> Any:
    """The caller's current stream: torch's for torch tensors, else CuPy's (none on the emulator)."""
    if _EMULATED.get():
        return contextlib.nullcontext()
    cupy = importlib.import_module("cupy")
    if framework == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return cupy.cuda.get_current_stream()


def rule_arguments(problem: AttentionProblem, extras: AttentionExtras) -> list[Any]:
    """causal, offset, window, mask (pointer, kind, four strides) and key_lengths, in kernel order."""
    left, right = problem.window if problem.window is not None else (-1, -1)
    null = np.uint64(0)
    mask = extras.mask
    if mask is None:
        mask_arguments = [null, np.int32(0)] + [np.int64(0)] * 4
    else:
        mask_strides = [0 if size == 1 else stride // mask.itemsize for size, stride in zip(mask.shape, mask.strides)]
        mask_arguments = [mask, np.int32(MASK_KINDS[mask.dtype.name])] + [np.int64(s) for s in mask_strides]
    return [
        np.int32(problem.causal is not None), np.int32(problem.key_offset), np.int32(left), np.int32(right),
        *mask_arguments,
        null if extras.key_lengths is None else extras.key_lengths,
    ]  # fmt: skip


def contract_arguments(problem: AttentionProblem, extras: AttentionExtras) -> list[Any]:
    """The tensor-core kernels' trailing arguments: seq_q, seq_k, group, scale, softcap, then
    :func:`rule_arguments`."""
    return [
        np.int32(problem.seq_q), np.int32(problem.seq_k), np.int32(problem.group_size),
        np.float32(problem.scale), np.float32(problem.softcap or 0.0),
        *rule_arguments(problem, extras),
    ]  # fmt: skip


def multiprocessors() -> int:
    """Streaming multiprocessors of the current device (the emulated device's inside :func:`emulated`)."""
    if _EMULATED.get():
        return int(os.environ.get("FASTATTN_EMULATED_SMS", EMULATED_MULTIPROCESSORS))
    cupy = importlib.import_module("cupy")
    return _multiprocessors(int(cupy.cuda.Device().id))


@functools.cache
def _multiprocessors(device: int) -> int:
    cupy = importlib.import_module("cupy")
    return int(cupy.cuda.Device(device).attributes["MultiProcessorCount"])
