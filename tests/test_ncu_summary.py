"""benchmarks/ncu_summary.py against an excerpt of a real Nsight Compute SASS page (H100, 2026-11-26):
three instructions of fastattn's forward and two of FlashAttention-2's, their counters as printed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PAGE = Path(__file__).resolve().parent / "data" / "ncu_sass_page.txt"


@pytest.fixture(scope="module")
def ncu_summary():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import ncu_summary

        yield ncu_summary
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_parse_finds_each_kernel_with_its_instructions(ncu_summary):
    kernels = ncu_summary.parse(PAGE.read_text())
    names = list(kernels)
    assert names[0] == (
        "void fastattn_gpu::flash_forward<__nv_bfloat16, (int)128, (int)64, (bool)0, (bool)0>(fastattn_gpu::Params)"
    )
    assert names[1].startswith("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<(int)128, (int)128")
    columns, rows = kernels[names[0]]
    assert [row[1] for row in rows] == [
        "LDGSTS.E.BYPASS.128 desc[UR12][R90.64], P4, [R111]",
        "LDSM.16.M88.4 R116, [R16]",
        "HMMA.16816.F32.BF16 R124, R136, R144, R124",
    ]
    assert "instructionsexecuted" in columns and "l1wavefrontssharedideal" in columns
    assert len(kernels[names[1]][1]) == 2


def test_summary_reports_wavefronts_and_sectors_per_instruction(ncu_summary):
    (name, (columns, rows)), _ = ncu_summary.parse(PAGE.read_text()).items()
    text = ncu_summary.summarize(name, columns, rows, top=2)
    lines = text.splitlines()
    assert "SASS instructions 3, executed 3,129,344" in lines
    ldgsts = next(line.split() for line in lines if line.strip().startswith("LDGSTS"))
    # 10,838,016 wavefronts (ideal 4,128,768) and 24,772,608 sectors (ideal 16,515,072) over 1,032,192 executions
    assert ldgsts[1:] == ["1", "1,032,192", "10.50", "/", "4.00", "24.00", "/", "16.00"]
    assert lines[-2].split()[:2] == ["8531", "short_sb"]
    stalls = next(line for line in lines if line.startswith("stalls"))
    assert stalls.startswith("stalls (share of warp samples): short_sb 60.4%, barrier 30.7%")


def test_opcode_reads_past_a_predicate(ncu_summary):
    assert ncu_summary.opcode("@!P6  STG.E desc[UR16][R8.64], R148") == "STG"
    assert ncu_summary.opcode("HMMA.16816.F32.BF16 R4, R40, R44, R4") == "HMMA"
