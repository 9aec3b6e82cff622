"""Build the ``fastattn._cpu`` extensions, with OpenMP where the compiler has it.

OpenMP support is probed by compiling and linking a tiny program with ``-fopenmp``.  Where the
probe fails (a compiler without OpenMP) the extensions are built serially and the build says so;
it never fails for want of OpenMP.  ``FASTATTN_DISABLE_OPENMP=1`` forces the serial build.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

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


def _native_flags() -> list[str]:
    """``-march=native`` (the kernels use the build machine's vector unit) unless disabled."""
    if os.environ.get("FASTATTN_NATIVE", "1") == "0" or sys.platform == "win32":
        print("fastattn: portable build (FASTATTN_NATIVE=0): generic vector code")
        # 32-byte vectors without AVX make GCC note an ABI detail of passing them; nothing to act on.
        return [] if sys.platform == "win32" else ["-Wno-psabi"]
    print("fastattn: building the kernels for this machine's CPU (-march=native; FASTATTN_NATIVE=0 to disable)")
    return ["-march=native"]


def _sanitizer_flags() -> list[str]:
    """AddressSanitizer + UndefinedBehaviorSanitizer when FASTATTN_SANITIZE=1 (a test build).

    Python itself is not instrumented, so the ASan runtime must be loaded first:
    ``LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 pytest tests/conformance``
    (leak detection off: the interpreter keeps its own allocations until exit).  Any UB report aborts.
    """
    if os.environ.get("FASTATTN_SANITIZE", "0") != "1" or sys.platform == "win32":
        return []
    print("fastattn: sanitizer build (FASTATTN_SANITIZE=1): -fsanitize=address,undefined")
    return ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]


_omp = _openmp_flags()
_sanitize = _sanitizer_flags()
_compile_args = ["-O3"] if sys.platform != "win32" else ["/O2"]
_kernel_args = _compile_args + _native_flags() + ["-std=gnu++17"] + _sanitize
_link_args = (_omp + _sanitize) if sys.platform != "win32" else []

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
    # Built like the kernels (C++, same flags, same headers) so that the compiler, OpenMP and SIMD
    # width it reports are the kernels' own.
    Extension(
        "fastattn._cpu._runtime",
        ["fastattn/_cpu/_runtime.pyx"],
        include_dirs=["fastattn/_cpu"],
        language="c++",
        depends=["fastattn/_cpu/simd.h", "fastattn/_cpu/_omp_shim.h"],
        extra_compile_args=_kernel_args + _omp,
        extra_link_args=_link_args,
    ),
    Extension(
        "fastattn._cpu._flash",
        ["fastattn/_cpu/_flash.pyx"],
        # numpy's C API gives the arrays' addresses and strides without making Python objects.
        include_dirs=["fastattn/_cpu", "fastattn/_shared", numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION")],
        language="c++",
        depends=[
            "fastattn/_cpu/flash_forward.h",
            "fastattn/_cpu/flash_backward.h",
            "fastattn/_shared/philox.h",
            "fastattn/_cpu/simd.h",
            "fastattn/_cpu/thread_scratch.h",
            "fastattn/_cpu/_omp_shim.h",
        ],
        extra_compile_args=_kernel_args + _omp,
        extra_link_args=_link_args,
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={"language_level": "3", "boundscheck": False, "wraparound": False},
        compile_time_env={},
    ),
)
