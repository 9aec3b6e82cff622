"""The CPU kernels' instruction-set levels: what the build holds, which one runs, and that each
level's machine code stays within its instruction set.

The conformance suite checks the numbers at every level (CI reruns its cpu tests with
``FASTATTN_ISA`` set to each level this machine runs); here the dispatch itself is checked.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import fastattn
from fastattn._cpu import _flash, isa
from fastattn.backends import cpu

from .conformance import _oracle

X86_LEVELS = ["generic", "avx2", "avx512", "avx512bf16", "amx"]


@pytest.fixture
def restore_level() -> Iterator[None]:
    before = isa.active()
    yield
    isa.select(before)


def test_levels_are_named_ordered_and_the_highest_runnable_is_the_default() -> None:
    levels = isa.levels()
    names = [level.name for level in levels]
    assert names in (X86_LEVELS, ["generic"], ["native"]), names
    assert levels[0].runs, "the lowest level must run on any CPU of its architecture"
    assert all(level.vector_bytes in (32, 64) for level in levels)
    forced = os.environ.get(isa.ENVIRONMENT_VARIABLE)
    assert isa.active() == (forced if forced else isa.runnable()[-1])


def test_vector_width_follows_the_level() -> None:
    widths = {level.name: level.vector_bytes for level in isa.levels()}
    if "avx512" in widths:
        assert widths == {"generic": 32, "avx2": 32, "avx512": 64, "avx512bf16": 64, "amx": 64}


@pytest.mark.parametrize("name", isa.runnable())
def test_each_runnable_level_computes_attention_and_its_gradients(name: str, restore_level: None) -> None:
    rng = np.random.default_rng()
    q, dout = (rng.standard_normal((1, 4, 37, 24)) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 45, 24)) for _ in range(2))
    window = (int(rng.integers(3, 20)), int(rng.integers(0, 5)))
    options = _oracle.Options(causal=True, window=window, softcap=4.0)
    isa.select(name)
    q32, k32, v32, dout32 = (x.astype(np.float32) for x in (q, k, v, dout))
    call = {"causal": True, "window": window, "softcap": 4.0, "backend": "cpu"}
    out, lse = fastattn.attention(q32, k32, v32, return_lse=True, **call)
    grads = fastattn.attention_backward(dout32, q32, k32, v32, out, lse, **call)
    plans = [plan for key, (_, plan) in {**cpu._forward_plans, **cpu._backward_plans}.items() if key[2] == name]
    assert plans and all(plan.isa == name for plan in plans)
    expected_out, expected_lse = _oracle.forward(q, k, v, options)
    expected = _oracle.backward(dout, q, k, v, options)
    np.testing.assert_allclose(out, expected_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)
    for grad, exact, size in zip(grads, expected[:3], expected.magnitudes):
        assert np.all(np.abs(grad - exact) <= 1e-5 + 1e-4 * size)


def test_an_unknown_level_is_refused_with_the_build_s_levels(restore_level: None) -> None:
    built = ", ".join(level.name for level in isa.levels())
    with pytest.raises(ValueError, match=re.escape(f"expected one of this build's ({built}), received 'sse9'")):
        isa.select("sse9")


def test_a_level_this_cpu_cannot_run_is_refused(restore_level: None) -> None:
    missing = [level.name for level in isa.levels() if not level.runs]
    if not missing:
        pytest.skip("this CPU runs every level of the build")
    with pytest.raises(ValueError, match="this CPU cannot run it"):
        isa.select(missing[0])


def test_the_environment_forces_a_level_and_a_bad_name_warns() -> None:
    script = "from fastattn._cpu import isa; print(isa.active())"
    lowest = isa.levels()[0].name
    forced = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "FASTATTN_ISA": lowest}, capture_output=True, text=True
    )
    assert forced.returncode == 0 and forced.stdout.strip() == lowest, forced.stderr
    wrong = subprocess.run(
        [sys.executable, "-W", "always", "-c", script],
        env={**os.environ, "FASTATTN_ISA": "sse9"},
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 0 and wrong.stdout.strip() == isa.runnable()[-1], wrong.stderr
    assert "RuntimeWarning: FASTATTN_ISA=sse9: instruction-set level: expected one of" in wrong.stderr


def _functions(library: Path) -> dict[str, list[str]]:
    """Each function's instruction lines (mnemonic and operands), by demangled name."""
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", str(library)], capture_output=True, text=True, check=True
    ).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in listing.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            current = functions.setdefault(header.group(1), [])
        elif current is not None and re.match(r"^\s+[0-9a-f]+:\t", line):
            current.append(line.split("\t", 1)[1].strip())
    return functions


def _level_of(function: str) -> str | None:
    found = re.search(r"\bisa_(\w+)::", function)
    return found.group(1) if found else None


#: AVX: VEX-encoded mnemonics start with "v" (legacy SSE never does); AVX-512 adds zmm and mask registers.
AVX = re.compile(r"^v[a-z]|%ymm|%zmm|%k[0-7]")
AVX512 = re.compile(r"%zmm|%k[0-7]|\{%k")
#: AVX512_BF16: the bfloat16 dot product and conversions (the avx512bf16 and amx levels).
BF16 = re.compile(r"^vdpbf16ps|^vcvtne2?ps2bf16")
#: AMX: the tile instructions and registers (only the amx level may use them).
AMX = re.compile(r"%tmm|tilecfg|^tile|^tdp")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("objdump") is None, reason="needs objdump on Linux"
)
def test_each_level_uses_no_instruction_above_it() -> None:
    names = [level.name for level in isa.levels()]
    if names != X86_LEVELS:
        pytest.skip(f"not a multi-level x86-64 build: {names}")
    functions = _functions(Path(_flash.__file__))
    assert set(X86_LEVELS) <= {_level_of(name) for name in functions}
    above_avx512 = re.compile(f"{BF16.pattern}|{AMX.pattern}")
    forbidden = {None: AVX, "generic": AVX, "avx2": AVX512, "avx512": above_avx512, "avx512bf16": AMX}
    for name, instructions in functions.items():
        level = _level_of(name)
        if level not in forbidden:
            continue
        found = [instruction for instruction in instructions if forbidden[level].search(instruction)]
        assert not found, f"{name} ({level or 'outside the kernel levels'}) uses {found[:3]}"
    amx_level = [line for name, lines in functions.items() if _level_of(name) == "amx" for line in lines]
    assert any(AMX.search(line) for line in amx_level), "the amx level's kernels use no tile instruction"
    bf16_level = [line for name, lines in functions.items() if _level_of(name) == "avx512bf16" for line in lines]
    assert any(line.startswith("vdpbf16ps") for line in bf16_level), "the avx512bf16 level runs no vdpbf16ps"
