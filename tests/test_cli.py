"""``python -m fastattn info | bench``: build facts, the bench's table, JSON, plot and failures.

The benchmark runs here on tiny cases (patched in) so that it takes a second; the README's
``python -m fastattn bench --quick`` runs the real quick suite in CI.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fastattn
from fastattn import __main__ as cli
from fastattn import _bench, backends
from fastattn._cpu import isa

TINY_CASES = (
    _bench.BenchCase("tiny-gqa", 1, 4, 2, 16, 24, 16, False),
    _bench.BenchCase("tiny-bf16", 1, 4, 2, 16, 24, 16, True, "bfloat16"),
)
TINY_SWEEP = _bench.sweep((16, 32))
CUDA_AVAILABLE = backends.available()["cuda"].available
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTATTN_BACKEND", raising=False)


@pytest.fixture
def tiny_suite(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench, "QUICK_CASES", TINY_CASES)
    monkeypatch.setattr(_bench, "QUICK_SWEEP", TINY_SWEEP)
    monkeypatch.setattr(_bench, "SETTLE_SECONDS", 0.0)


def test_info_reports_version_build_blas_gpu_and_every_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"fastattn {fastattn.__version__} on Python" in out
    build = next(line for line in out.splitlines() if line.startswith("cpu kernels: "))
    assert any(compiler in build for compiler in ("GCC ", "Clang ")), build
    assert "OpenMP" in build
    instruction_set = next(line for line in out.splitlines() if line.startswith("cpu instruction set: "))
    assert instruction_set.startswith(f"cpu instruction set: {isa.active()}, ") and "-byte vectors" in instruction_set
    assert f"threads: {fastattn.get_num_threads()} " in out
    assert "numpy BLAS: " in out and "GPU: " in out
    for name, status in backends.available().items():
        state = "available" if status.available else "unavailable"
        assert any(line.split() and line.split()[0] == name and state in line for line in out.splitlines()), name
    if not CUDA_AVAILABLE:
        assert "cuda" in out.split("backends:")[1] and "unavailable: " in out


def test_runtime_reports_compiler() -> None:
    from fastattn._cpu import _runtime

    assert _runtime.compiler().split()[0] in ("GCC", "Clang")


def test_bench_quick_writes_table_json_and_plot(
    tiny_suite: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "bench.json"
    plot_path = tmp_path / "bench.png"
    argv = ["bench", "--quick", "--json", str(json_path)] + (["--plot", str(plot_path)] if HAS_MATPLOTLIB else [])
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "median ms" in captured.out and "max |err|" in captured.out and "x numpy" in captured.out
    assert "bench" in captured.err  # the progress bar
    document = json.loads(json_path.read_text())
    assert set(document) == {"environment", "cases", "sweep", "rows"}
    assert document["environment"]["fastattn"] == fastattn.__version__
    assert [case["name"] for case in document["sweep"]] == ["causal-16", "causal-32"]
    names = {row["implementation"] for row in document["rows"]}
    expected = {"numpy naive", "fastattn cpu", "fastattn reference"} | ({"torch sdpa"} if HAS_TORCH else set())
    assert names == expected
    cases = [case.name for case in TINY_CASES + TINY_SWEEP]
    assert len(document["rows"]) == len(cases) * len(expected)
    for row in document["rows"]:
        assert row["case"] in cases
        if row["case"] == "tiny-bf16" and row["implementation"] == "numpy naive":
            assert row["median_ms"] is None and row["note"].startswith("float32 only"), row
            continue
        assert row["median_ms"] > 0 and row["gflops"] > 0
        # bfloat16: the output's rounding alone is up to 2^-8 relative
        assert row["max_abs_error"] < (1e-2 if row["case"] == "tiny-bf16" else 1e-5), row
    if HAS_MATPLOTLIB:
        assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_says_so(
    tiny_suite: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "matplotlib" else find_spec(name, *args)
    )
    assert cli.main(["bench", "--quick", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_bench_output_in_a_missing_directory_fails_before_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "missing" / "out.json"
    assert cli.main(["bench", "--quick", "--json", str(path)]) == 2
    assert "--json: expected a file path in an existing directory" in capsys.readouterr().err


@pytest.mark.skipif(CUDA_AVAILABLE, reason="the cuda backend is available here")
def test_bench_cuda_without_the_backend_exits_2_with_the_reason() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fastattn", "bench", "--device", "cuda"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--device cuda needs the cuda backend, which is unavailable here: " in result.stderr
    assert backends.available()["cuda"].detail in result.stderr


def test_a_declining_backend_gets_a_row_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_bench, "SETTLE_SECONDS", 0.0)

    class Declines:
        name = "declines"
        devices = ("cpu",)
        priority = -50

        def not_supported_reasons(self, problem: Any) -> list[str]:
            return ["this test backend declines everything"]

        def forward(self, *args: Any) -> Any:
            raise AssertionError("never selected")

        def backward(self, *args: Any) -> Any:
            raise AssertionError("never selected")

    backends.register(Declines())
    try:
        rows = _bench.run_cases(TINY_CASES, repeats=1, progress=False)
        table = _bench.format_table(rows, TINY_CASES)
    finally:
        backends.unregister("declines")
    declined = [row for row in rows if row.implementation == "fastattn declines"]
    assert len(declined) == len(TINY_CASES)
    for row in declined:
        assert row.median_ms is None and row.note == "declined: this test backend declines everything"
    assert "declined: this test backend declines everything" in table
    assert TINY_CASES[0].describe() in table


def test_naive_attention_matches_the_reference() -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 9, 8))
    k = rng.standard_normal((2, 2, 9, 8))
    v = rng.standard_normal((2, 2, 9, 8))
    for causal in (False, True):
        expected = fastattn.attention(q, k, v, causal=causal, backend="reference")
        np.testing.assert_allclose(_bench.numpy_naive_attention(q, k, v, causal), expected, rtol=1e-12, atol=1e-12)


def test_suites_follow_the_documented_shapes() -> None:
    assert [case.seq_q for case in _bench.QUICK_SWEEP] == [128, 256, 512, 1024]
    for case in _bench.QUICK_SWEEP + _bench.FULL_SWEEP:
        assert (case.batch, case.heads_q, case.heads_kv, case.head_dim, case.causal) == (1, 8, 8, 64, True)
        assert case.seq_q == case.seq_k
        assert case.flops == 2.0 * case.heads_q * case.seq_q**2 * case.head_dim
    assert set(_bench.QUICK_CASES) <= set(_bench.FULL_CASES)
    assert {case.dtype for case in _bench.QUICK_CASES} == {"float32", "bfloat16"}
    assert any(case.seq_q == 1 and case.dtype == "bfloat16" for case in _bench.QUICK_CASES)  # bf16 decode
