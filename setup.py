"""Build the ``fastattn._cpu`` extensions, with OpenMP where the compiler has it.

The kernels are compiled once per instruction-set level (on x86-64: generic, AVX2+FMA, AVX-512),
and ``fastattn._cpu._flash`` picks the highest level the CPU runs at import (``FASTATTN_ISA``
forces a lower one), so a build made on one x86-64 machine runs at full speed on any.
``FASTATTN_NATIVE=1`` builds one ``-march=native`` level instead, for the building machine alone.

OpenMP support is probed by compiling and linking a tiny program with ``-fopenmp``.  Where the
probe fails (a compiler without OpenMP) the extensions are built serially and the build says so;
it never fails for want of OpenMP.  ``FASTATTN_DISABLE_OPENMP=1`` forces the serial build.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_OPENMP_PROBE = r"""
#include <omp.h>
int main(void) {
    int n = 0;
    #pragma omp parallel reduction(+:n)
    n += 1;
    return n > 0 ? 0 : 1;
}
"""


def _compiler() -> str:
    return os.environ.get("CC") or sysconfig.get_config_var("CC").split()[0] or "cc"


def _openmp_flags() -> list[str]:
    """Return the OpenMP compile/link flag list, or [] where OpenMP cannot be used."""
    if os.environ.get("FASTATTN_DISABLE_OPENMP") == "1":
        print("fastattn: OpenMP disabled by FASTATTN_DISABLE_OPENMP=1; building serial kernels")
        return []
    if sys.platform == "win32":
        return ["/openmp"]
    compiler = _compiler()
    if shutil.which(compiler) is None:
        print(f"fastattn: compiler {compiler!r} not found for the OpenMP probe; building serial kernels")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "probe.c")
        with open(source, "w") as handle:
            handle.write(_OPENMP_PROBE)
        result = subprocess.run(
            [compiler, "-fopenmp", source, "-o", os.path.join(tmp, "probe")],
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        print(
            f"fastattn: {compiler} cannot build OpenMP code ({result.stderr.strip()[:200]}); "
            "building serial kernels"
        )
        return []
    print(f"fastattn: building the CPU kernels with OpenMP ({compiler} -fopenmp)")
    return ["-fopenmp"]


class IsaLevel(NamedTuple):
    """One instruction-set level the kernels are compiled for (fastattn/_cpu/isa.h)."""

    name: str
    flags: list[str]


#: x86-64 levels, lowest first; fastattn/_cpu/dispatch.h checks the same extensions by CPUID.
_X86_LEVELS = [
    IsaLevel("generic", ["-march=x86-64", "-mtune=generic"]),
    IsaLevel("avx2", ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mf16c"]),
    IsaLevel("avx512", ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
                        "-mavx512dq", "-mavx512vl"]),
    # AVX-512 with AVX512_BF16 (AMD Zen 4 and later, Intel Cooper Lake and later): bfloat16 on vdpbf16ps.
    IsaLevel("avx512bf16", ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
                            "-mavx512dq", "-mavx512vl", "-mavx512bf16"]),
    # AVX-512 with AVX512_BF16 and AMX-BF16 tiles (Sapphire Rapids and later): bfloat16 on AMX.
    IsaLevel("amx", ["-march=x86-64", "-mtune=generic", "-mavx2", "-mfma", "-mavx512f", "-mavx512bw",
                     "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"]),
]


def _isa_levels() -> list[IsaLevel]:
    """The levels to compile the kernels for.

    x86-64 with GCC or Clang: every level of ``_X86_LEVELS``; the extension picks one at import.
    ``FASTATTN_NATIVE=1`` (opt-in): one level built with ``-march=native`` for this machine alone.
    Elsewhere: one generic level with the compiler's default target.
    """
    if os.environ.get("FASTATTN_NATIVE", "0") == "1" and sys.platform != "win32":
        print("fastattn: FASTATTN_NATIVE=1: kernels built for this machine's CPU alone (-march=native)")
        return [IsaLevel("native", ["-march=native"])]
    machine = platform.machine().lower()
    if sys.platform != "win32" and machine in ("x86_64", "amd64"):
        print("fastattn: kernels built for " + ", ".join(level.name for level in _X86_LEVELS) + "; chosen at import")
        return _X86_LEVELS
    # 32-byte vectors without AVX make GCC note an ABI detail of passing them; nothing to act on.
    return [IsaLevel("generic", [] if sys.platform == "win32" else ["-Wno-psabi"])]


def _sanitizer_flags() -> list[str]:
    """AddressSanitizer + UndefinedBehaviorSanitizer when FASTATTN_SANITIZE=1 (a test build).

    Python itself is not instrumented, so the ASan runtime must be loaded first:
    ``LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 pytest tests/conformance``
    (leak detection off: the interpreter keeps its own allocations until exit).  Any UB report aborts.
    """
    if os.environ.get("FASTATTN_SANITIZE", "0") != "1" or sys.platform == "win32":
        return []
    print("fastattn: sanitizer build (FASTATTN_SANITIZE=1): -O1 -fsanitize=address,undefined")
    return ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]


_omp = _openmp_flags()
_sanitize = _sanitizer_flags()
#: -O1 under the sanitizers (their documented setting): every access is checked at any level, and the
#: sanitized -march=native build took 342 s at -O3 and 129 s at -O1 on a 2-core Zen 3, with the
#: conformance suite no slower.
_compile_args = (["-O1"] if _sanitize else ["-O3"]) if sys.platform != "win32" else ["/O2"]
_levels = _isa_levels()
_cxx_args = _compile_args + ["-std=gnu++17"] + _sanitize
_link_args = (_omp + _sanitize) if sys.platform != "win32" else []
#: The extension code around the kernels (Cython, dispatch) runs on every CPU: the lowest level's flags.
_baseline_args = _cxx_args + _levels[0].flags
#: One level's kernels, in four translation units (kernel_entries.h) so that a level's forward (in
#: two halves by dtype) and backward compile on several cores at once; the heaviest first.  With the
#: forward in one unit, the sanitized build (.ci/run) waited on it alone: ~125 s of -O1 on a 2-core
#: Zen 3, ~60 s for each half.
_kernel_sources = [
    "fastattn/_cpu/kernels_forward.cpp",
    "fastattn/_cpu/kernels_forward_half.cpp",
    "fastattn/_cpu/kernels_backward.cpp",
    "fastattn/_cpu/kernels.cpp",
]
_kernel_headers = [
    "fastattn/_cpu/forward_tiles.h",
    "fastattn/_cpu/visibility.h",
    "fastattn/_cpu/micro_kernels.h",
    "fastattn/_cpu/flash_forward.h",
    "fastattn/_cpu/flash_decode.h",
    "fastattn/_cpu/forward_items.h",
    "fastattn/_cpu/flash_amx.h",
    "fastattn/_cpu/flash_bf16.h",
    "fastattn/_cpu/flash_backward.h",
    "fastattn/_cpu/flash_backward_bf16.h",
    "fastattn/_cpu/mask_tiles.h",
    "fastattn/_cpu/simd.h",
    "fastattn/_cpu/isa.h",
    "fastattn/_cpu/params.h",
    "fastattn/_cpu/kernel_table.h",
    "fastattn/_cpu/kernel_entries.h",
    "fastattn/_shared/philox.h",
]


class BuildWithKernelLevels(build_ext):
    """build_ext that compiles the kernel sources once per instruction-set level into ``_flash``.

    Each level's objects get its target flags and its namespace (fastattn/_cpu/isa.h); every
    (level, source) pair is one compiler process, as many at once as there are cores, the sources
    with the most code first so that the last to finish are short.
    """

    def build_extension(self, ext: Extension) -> None:
        if ext.name == "fastattn._cpu._flash":
            ext.extra_objects = self._kernel_objects(ext)
        super().build_extension(ext)

    def _kernel_objects(self, ext: Extension) -> list[str]:
        def compile_one(job: tuple[str, IsaLevel]) -> list[str]:
            source, level = job
            return self.compiler.compile(
                [source],
                output_dir=os.path.join(self.build_temp, "isa_" + level.name),
                macros=[("FASTATTN_ISA_NAMESPACE", "isa_" + level.name), ("FASTATTN_ISA_NAME", f'"{level.name}"')],
                include_dirs=ext.include_dirs,
                extra_postargs=_cxx_args + level.flags,
                depends=_kernel_headers,
            )

        jobs = [(source, level) for source in _kernel_sources for level in reversed(_levels)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            return [obj for objects in pool.map(compile_one, jobs) for obj in objects]


def _numpy_c_api_extension(name: str) -> Extension:
    """A small C extension of the call path on numpy's C API (no kernels: plain optimisation flags)."""
    return Extension(
        name,
        [name.replace(".", "/") + ".pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")],
        extra_compile_args=_compile_args + _sanitize,
        extra_link_args=_sanitize if sys.platform != "win32" else [],
    )


extensions = [
    # Host DLPack tensors (torch's) viewed as numpy arrays without Python-level conversion.
    _numpy_c_api_extension("fastattn._dlpack"),
    # The key validated calls are remembered under (numpy's C API reads the arrays' descriptions).
    _numpy_c_api_extension("fastattn._describe"),
    # The compiler and OpenMP runtime of the kernels (C++, the kernels' OpenMP flags).
    Extension(
        "fastattn._cpu._runtime",
        ["fastattn/_cpu/_runtime.pyx"],
        include_dirs=["fastattn/_cpu"],
        language="c++",
        depends=["fastattn/_cpu/_omp_shim.h"],
        extra_compile_args=_baseline_args + _omp,
        extra_link_args=_link_args,
    ),
    Extension(
        "fastattn._cpu._flash",
        ["fastattn/_cpu/_flash.pyx"],
        # numpy's C API gives the arrays' addresses and strides without making Python objects.
        include_dirs=["fastattn/_cpu", "fastattn/_shared", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")]
        + [("FASTATTN_LEVEL_" + level.name.upper(), "1") for level in _levels],
        language="c++",
        depends=[*_kernel_sources, *_kernel_headers, "fastattn/_cpu/dispatch.h", "fastattn/_cpu/thread_scratch.h",
                 "fastattn/_cpu/result_blocks.h",
                 "fastattn/_cpu/_omp_shim.h"],
        extra_compile_args=_baseline_args + _omp,
        extra_link_args=_link_args,
    ),
]

setup(
    cmdclass={"build_ext": BuildWithKernelLevels},
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
        compile_time_env={},
    ),
)
