"""Run CUDA kernels on the CPU: compile a source with the host C++ compiler against ``simt.h``.

The emulator executes the unchanged ``.cu`` sources of ``fastattn/_gpu/kernels`` (their PTX
helpers in ``ptx.cuh`` have emulated forms, chosen by ``FASTATTN_EMULATE``), so kernels can be
tested where there is no GPU.  This module is the driver, shaped like CuPy's ``RawModule``:

>>> module = compile_source(text, ("fastattn_gpu::fp32_forward<64>",))     # doctest: +SKIP
>>> module.get_function("fastattn_gpu::fp32_forward<64>")(grid, block, args, shared_mem=n)  # doctest: +SKIP

* The source is the launcher's (``_launch.source_text``: headers inlined), with each
  ``extern __shared__ T name[];`` turned into a pointer to the block's dynamic shared memory (the one
  construct a macro cannot express), and one ``extern "C"`` entry point per kernel instance.
* Each text is compiled once, into a cache directory keyed by the hash of the text, the flags and
  the compiler (``$FASTATTN_EMULATOR_CACHE``, else ``~/.cache/fastattn/emulator``), as NVRTC's cache
  is keyed by the source.  It links the runtime (``simt_runtime.cpp``: fibers, scheduler,
  collectives), built once per flags and compiler into the same directory, so that a kernel's build
  compiles the kernel alone.
* Arguments are marshalled as CuPy marshals them: an array passes its address, a numpy scalar its
  bytes.  Each must have the byte size of the kernel's parameter, which the library reports.
* A launch returns when every block has run; an error in a block (a barrier misuse, a write outside
  shared memory, a lane missing from a warp collective) raises :class:`EmulationError`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HEADER_DIR = Path(__file__).parent
#: The kernels' own headers (ptx.cuh and the rest) and those shared with the CPU build (philox.h),
#: on the include path of every emulated build.
INCLUDE_DIRS = (HEADER_DIR.parent / "kernels", HEADER_DIR.parent.parent / "_shared")
#: Flags of every emulated build (``FASTATTN_EMULATOR_SANITIZE=1`` adds AddressSanitizer).
FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-DFASTATTN_EMULATE", "-Wno-unused-function")
_SANITIZE_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")
_EXTERN_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([A-Za-z_][\w\s:]*?)\s+([A-Za-z_]\w*)\s*\[\s*\]\s*;"
)
_ERROR_BYTES = 4096
_MAX_PARAMETERS = 128


class EmulationError(RuntimeError):
    """A kernel did something the device would not survive or would make racy."""


def emulated_text(text: str) -> str:
    """``text`` with every ``extern __shared__ T name[];`` bound to the block's dynamic shared memory."""
    return _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1)}* {m.group(2)} = fastattn_emu::dynamic_shared<{m.group(1)}>();", text
    )


def _entry_points(names: tuple[str, ...]) -> str:
    """One ``extern "C"`` launch function and one signature function per kernel instance."""
    lines = ["\n// Entry points of the emulator's driver (fastattn/_gpu/emulator/__init__.py).\n"]
    for index, name in enumerate(names):
        lines.append(
            f'extern "C" int fastattn_emu_launch_{index}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
            f"unsigned by, unsigned bz, unsigned long long shared_bytes, void** arguments, "
            f"unsigned long long seed, char* error, unsigned long long error_bytes) {{\n"
            f"    return fastattn_emu::launch_kernel(&{name}, dim3(gx, gy, gz), dim3(bx, by, bz), shared_bytes, "
            f"arguments, seed, error, error_bytes);\n}}\n"
            f'extern "C" int fastattn_emu_signature_{index}(unsigned long long* sizes, int capacity) {{\n'
            f"    return fastattn_emu::parameter_sizes(&{name}, sizes, capacity);\n}}\n"
        )
    return "".join(lines)


def compiler() -> str:
    """The host C++ compiler the emulated builds use (``$CXX``, else g++, c++ or clang++)."""
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if found is None:
        raise EmulationError("the SIMT emulator needs a C++17 compiler (g++ or clang++); none was found")
    return found


def cache_dir() -> Path:
    """Where compiled emulator libraries are kept."""
    configured = os.environ.get("FASTATTN_EMULATOR_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastattn" / "emulator"


def _flags() -> tuple[str, ...]:
    sanitize = os.environ.get("FASTATTN_EMULATOR_SANITIZE", "0") == "1"
    return FLAGS + (_SANITIZE_FLAGS if sanitize else ())


def _build(compile_flags: list[str], source: str, link_flags: list[str], target: Path, what: str) -> None:
    """Compile the C++ ``source`` text into the shared library ``target``: built in a scratch folder
    beside it and moved there atomically, so a concurrent build of the same text (two pytest
    workers) is harmless."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        source_path = Path(work) / "source.cpp"
        source_path.write_text(source)
        built = Path(work) / target.name
        command = [compiler(), *compile_flags, str(source_path), *link_flags, "-o", str(built)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EmulationError(f"the emulated build of {what} failed:\n{result.stderr[-4000:]}")
        os.replace(built, target)


def _runtime(flags: tuple[str, ...], version: str) -> Path:
    """The runtime library for these flags and this compiler, built on first use."""
    texts = [(HEADER_DIR / name).read_text() for name in ("simt.h", "simt_runtime.cpp")]
    digest = hashlib.sha256("\0".join((*texts, " ".join(flags), version)).encode()).hexdigest()[:32]
    library = cache_dir() / f"simt-{digest}.so"
    if not library.exists():
        _build([*flags, f"-I{HEADER_DIR}"], texts[1], [f"-Wl,-soname,{library.name}"], library, "the runtime")
    return library


def compile_source(text: str, names: tuple[str, ...]) -> EmulatedModule:
    """Compile a CUDA source (headers already inlined) for the emulator, once per text and flags.

    Parameters
    ----------
    text : str
        The CUDA C++ source, as ``_launch.source_text`` returns it (or any self-contained source).
    names : tuple of str
        The kernel instances to expose, as CuPy's ``name_expressions``
        (``"fastattn_gpu::flash_forward<__half, 64, 128>"``).

    Returns
    -------
    EmulatedModule
    """
    compiler_path = compiler()
    flags = _flags()
    full_text = '#include "simt.h"\n' + emulated_text(text) + _entry_points(names)
    version = subprocess.run([compiler_path, "--version"], capture_output=True, text=True).stdout
    runtime = _runtime(flags, version)
    digest = hashlib.sha256("\0".join((full_text, runtime.name, " ".join(flags), version)).encode()).hexdigest()[:32]
    library = runtime.parent / f"{digest}.so"
    if not library.exists():
        # Linked to the runtime beside it, which the loader finds there ($ORIGIN).
        includes = [f"-I{HEADER_DIR}", *(f"-I{folder}" for folder in INCLUDE_DIRS)]
        linking = [f"-L{runtime.parent}", f"-l:{runtime.name}", "-Wl,-rpath,$ORIGIN"]
        _build([*flags, *includes], full_text, linking, library, "the kernels")
    return EmulatedModule(ctypes.CDLL(str(library)), names)


class EmulatedModule:
    """A compiled emulator library: its kernels by name, like CuPy's ``RawModule``."""

    def __init__(self, library: ctypes.CDLL, names: tuple[str, ...]) -> None:
        self._library = library
        self._names = names

    def get_function(self, name: str) -> EmulatedKernel:
        """The kernel instance ``name`` (one of the names the module was compiled with)."""
        if name not in self._names:
            raise KeyError(f"name: expected one of {self._names}, received {name!r}")
        index = self._names.index(name)
        return EmulatedKernel(
            name,
            getattr(self._library, f"fastattn_emu_launch_{index}"),
            getattr(self._library, f"fastattn_emu_signature_{index}"),
        )


class EmulatedKernel:
    """One kernel instance, called like a CuPy ``RawKernel``: ``kernel(grid, block, args, shared_mem=)``."""

    def __init__(self, name: str, launch: Any, signature: Any) -> None:
        self.name = name
        self._launch = launch
        self._launch.restype = ctypes.c_int
        sizes = (ctypes.c_ulonglong * _MAX_PARAMETERS)()
        count = signature(sizes, _MAX_PARAMETERS)
        self.parameter_sizes = tuple(int(size) for size in sizes[:count])

    def __call__(
        self,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        *,
        shared_mem: int = 0,
        seed: int = 0,
    ) -> None:
        """Run the kernel over ``grid`` blocks of ``block`` threads; raise :class:`EmulationError` on
        the first error of any block.  ``seed`` picks the order the threads of a block run in."""
        if len(args) != len(self.parameter_sizes):
            raise TypeError(f"{self.name}: expected {len(self.parameter_sizes)} arguments, received {len(args)}")
        buffers = [
            _argument_bytes(self.name, i, value, size)
            for i, (value, size) in enumerate(zip(args, self.parameter_sizes))
        ]
        pointers = (ctypes.c_void_p * max(1, len(buffers)))(*(ctypes.addressof(buffer) for buffer in buffers))
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        dims = [ctypes.c_uint(size) for size in (gx, gy, gz, bx, by, bz)]
        status = self._launch(
            *dims,
            ctypes.c_ulonglong(shared_mem),
            pointers,
            ctypes.c_ulonglong(seed),
            error,
            ctypes.c_ulonglong(_ERROR_BYTES),
        )
        if status != 0:
            raise EmulationError(f"{self.name}: {error.value.decode(errors='replace')}")


def _argument_bytes(name: str, index: int, value: Any, size: int) -> Any:
    """The bytes a kernel parameter receives: an array's address, or a numpy scalar's value."""
    if isinstance(value, np.ndarray):
        data = ctypes.c_void_p(value.ctypes.data)
        if size != ctypes.sizeof(data):
            raise TypeError(f"{name}: argument {index} is an array, but the parameter has {size} bytes")
        return data
    if isinstance(value, np.generic):
        raw = value.tobytes()
        if len(raw) != size:
            raise TypeError(
                f"{name}: argument {index} is a {value.dtype} of {len(raw)} bytes; the parameter has {size}"
            )
        return ctypes.create_string_buffer(raw, size)
    raise TypeError(
        f"{name}: argument {index}: expected a numpy array or a numpy scalar, received {type(value).__name__}"
    )
