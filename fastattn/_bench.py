"""The main job's benchmark: every available backend against plain numpy attention.

Each case is timed as the median of repeated runs after one warm-up, on float32 inputs; the
error column is the largest absolute difference from the float64 reference on the same inputs.
A backend that declines a case shows its first reason instead of a time.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import backends, functional


@dataclass(frozen=True)
class BenchCase:
    """One benchmark shape (layout bhsd, float32)."""

    name: str
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool

    @property
    def flops(self) -> float:
        """``4·B·Hq·Sq·Sk·D``, halved for causal with Sq = Sk (DESIGN.md §5)."""
        total = 4.0 * self.batch * self.heads_q * self.seq_q * self.seq_k * self.head_dim
        return total / 2 if self.causal and self.seq_q == self.seq_k else total


QUICK_CASES = (
    BenchCase("mha-256", 1, 8, 8, 256, 256, 64, False),
    BenchCase("causal-512", 1, 8, 8, 512, 512, 64, True),
    BenchCase("gqa-512", 1, 16, 4, 512, 512, 64, True),
    BenchCase("decode-2048", 4, 32, 8, 1, 2048, 128, False),
)
FULL_CASES = QUICK_CASES + (
    BenchCase("mha-1024", 1, 8, 8, 1024, 1024, 64, False),
    BenchCase("causal-2048", 1, 16, 16, 2048, 2048, 64, True),
)


@dataclass(frozen=True)
class BenchRow:
    """One measured (or declined) implementation on one case."""

    case: str
    implementation: str
    median_ms: float | None
    gflops: float | None
    max_abs_error: float | None
    note: str = ""


def numpy_naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """Plain numpy attention: materialise the scores, softmax, multiply (K/V repeated for GQA)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) / np.float32(math.sqrt(q.shape[-1]))
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        scores = np.where(np.tri(seq_q, seq_k, dtype=bool), scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (scores / scores.sum(axis=-1, keepdims=True)) @ v


def _median_ms(run: Callable[[], Any], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run_cases(cases: tuple[BenchCase, ...], repeats: int, progress: Callable[[str], None] = print) -> list[BenchRow]:
    """Time every available backend and numpy on each case; return the rows."""
    rng = np.random.default_rng(0)
    rows: list[BenchRow] = []
    names = [name for name, status in backends.available().items() if status.available]
    for case in cases:
        q = rng.standard_normal((case.batch, case.heads_q, case.seq_q, case.head_dim), dtype=np.float32)
        k = rng.standard_normal((case.batch, case.heads_kv, case.seq_k, case.head_dim), dtype=np.float32)
        v = rng.standard_normal((case.batch, case.heads_kv, case.seq_k, case.head_dim), dtype=np.float32)
        exact = functional.attention(
            *(x.astype(np.float64) for x in (q, k, v)), causal=case.causal, backend="reference"
        )
        candidates: dict[str, Callable[[], Any]] = {
            "numpy naive": lambda: numpy_naive_attention(q, k, v, case.causal)
        }
        for name in names:
            reasons = functional.explain(q, k, v, causal=case.causal).reasons[name]
            if reasons:
                rows.append(BenchRow(case.name, name, None, None, None, f"declined: {reasons[0]}"))
                continue
            candidates[name] = lambda name=name: functional.attention(q, k, v, causal=case.causal, backend=name)
        for name, run in candidates.items():
            progress(f"{case.name}: {name}")
            milliseconds = _median_ms(run, repeats)
            error = float(np.max(np.abs(np.asarray(run(), dtype=np.float64) - exact)))
            rows.append(BenchRow(case.name, name, milliseconds, case.flops / milliseconds / 1e6, error))
    return rows


def format_table(rows: list[BenchRow]) -> str:
    """Render rows as a fixed-width text table."""
    header = f"{'case':<13} {'implementation':<14} {'median ms':>10} {'GFLOP/s':>8} {'max |err|':>10}  note"
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.median_ms is None:
            lines.append(f"{row.case:<13} {row.implementation:<14} {'-':>10} {'-':>8} {'-':>10}  {row.note}")
        else:
            lines.append(
                f"{row.case:<13} {row.implementation:<14} {row.median_ms:>10.2f} {row.gflops:>8.1f} "
                f"{row.max_abs_error:>10.2e}  {row.note}"
            )
    return "\n".join(lines)


def write_json(rows: list[BenchRow], path: str, cases: tuple[BenchCase, ...]) -> None:
    """Write the rows and the cases' definitions to ``path``."""
    with open(path, "w") as handle:
        json.dump({"cases": [asdict(c) for c in cases], "rows": [asdict(r) for r in rows]}, handle, indent=2)
