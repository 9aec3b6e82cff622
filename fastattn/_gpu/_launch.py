"""What every GPU launcher needs: sources with their headers, compiled kernels, streams, the device.

Sources may ``#include "name.cuh"`` headers from ``kernels/`` and ``"name.h"`` headers shared with the
CPU build from ``fastattn/_shared`` (philox.h): :func:`source_text` inlines them, so NVRTC needs no
include path and CuPy's on-disk kernel cache keys on the whole text (an edited header recompiles).
nvcc (CI's compile check) and the emulator find the same headers on their include paths
(:data:`INCLUDE_DIRS`).
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

KERNELS = Path(__file__).with_name("kernels")
#: Headers shared with the CPU build (the Philox dropout mask).
SHARED = Path(__file__).parent.parent / "_shared"
#: Where the sources' ``#include "..."`` headers are found, in order.
INCLUDE_DIRS = (KERNELS, SHARED)
#: C++ element type of each input dtype of the tensor-core kernels.
ELEMENTS = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
_INCLUDE = re.compile(r'^#include "([A-Za-z0-9_]+\.(?:cuh|h))"$', re.MULTILINE)


def source_text(name: str) -> str:
    """The text of ``kernels/<name>`` with each local ``#include "x.cuh"`` (or ``"x.h"``) replaced by
    the header, found in :data:`INCLUDE_DIRS`.

    Headers that include headers are expanded in turn, each header once (they are ``#pragma once``
    anyway, and NVRTC, given no include path, could not find a second copy's include).
    """
    expanded: set[str] = set()

    def expand(file: str) -> str:
        if file in expanded:
            return ""
        expanded.add(file)
        path = next((folder / file for folder in INCLUDE_DIRS if (folder / file).exists()), None)
        if path is None:
            raise FileNotFoundError(f"{name}: #include \"{file}\" is in none of {[str(d) for d in INCLUDE_DIRS]}")
        return _INCLUDE.sub(lambda match: expand(match.group(1)), path.read_text())

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


def stream(framework: str) -> Any:
    """The caller's current stream: torch's for torch tensors, else CuPy's (none on the emulator)."""
    if _EMULATED.get():
        return contextlib.nullcontext()
    cupy = importlib.import_module("cupy")
    if framework == "torch":
        import torch

        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    return cupy.cuda.get_current_stream()


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


def aligned(array: Any) -> Any:
    """``array``, or a contiguous copy when its data or row strides are not 16-byte aligned.

    The tensor-core kernels copy rows in 16-byte chunks (cp.async and vector loads): a base
    address off 16 bytes (a view into a buffer) faults.
    """
    xp = array_module()
    offsets = [address(array), *(stride for size, stride in zip(array.shape[:3], array.strides[:3]) if size > 1)]
    if all(offset % 16 == 0 for offset in offsets):
        return array
    # A new buffer (the allocator aligns it): ascontiguousarray would hand back a contiguous view
    # whose only fault is its base address unchanged.
    return xp.array(array, order="C", copy=True)


_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # cudaDevAttrMaxSharedMemoryPerBlockOptin


def shared_memory_per_block() -> int:
    """The most dynamic shared memory one block may opt into on the current device (the emulated
    device's inside :func:`emulated`)."""
    if _EMULATED.get():
        return EMULATED_SHARED_MEMORY_PER_BLOCK
    cupy = importlib.import_module("cupy")
    return _shared_memory_per_block(int(cupy.cuda.runtime.getDevice()))


@functools.cache
def _shared_memory_per_block(device: int) -> int:
    cupy = importlib.import_module("cupy")
    return int(cupy.cuda.runtime.deviceGetAttribute(_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
