"""The dtype and mask codes: Python's table, the CPU headers and the CUDA headers agree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fastattn import _codes
from fastattn._gpu import params

PACKAGE = Path(_codes.__file__).parent
CPU_HEADER = PACKAGE / "_cpu" / "params.h"
GPU_HEADER = PACKAGE / "_gpu" / "kernels" / "common.cuh"


def enum_values(header: Path, enum: str) -> dict[str, int]:
    """The ``NAME = value`` pairs of ``enum <enum> { ... };`` in a C/C++ header."""
    match = re.search(rf"enum {enum} \{{([^}}]*)\}};", header.read_text())
    assert match is not None, f"no enum {enum} in {header}"
    pairs = (item.split("=") for item in match.group(1).split(","))
    return {name.strip(): int(value) for name, value in pairs}


def named(table: dict[str | None, int], prefix: str) -> dict[str, int]:
    """``{"float32": 2}`` as the headers spell it: ``{"MASK_FLOAT32": 2}``; None is NONE."""
    return {f"{prefix}_{(name or 'none').upper()}": code for name, code in table.items()}


@pytest.mark.parametrize("header", [CPU_HEADER, GPU_HEADER], ids=["cpu", "cuda"])
def test_mask_codes_match_the_headers(header: Path) -> None:
    assert enum_values(header, "MaskKind") == named(dict(_codes.MASK_CODES), "MASK")


def test_dtype_codes_match_the_cpu_header() -> None:
    assert enum_values(CPU_HEADER, "DtypeCode") == named(dict(_codes.DTYPE_CODES), "DTYPE")


def test_codes_are_distinct() -> None:
    for table in (_codes.DTYPE_CODES, _codes.MASK_CODES):
        assert len(set(table.values())) == len(table)


def test_gpu_launchers_take_their_codes_from_the_table() -> None:
    assert params.MASK_KINDS == {name: _codes.MASK_CODES[name] for name in ("bool", "float32", "float16", "bfloat16")}
