"""Many Python threads calling at once get exactly what a lone call gets.

The kernels release the GIL and keep all their state in per-call scratch, so concurrent calls must
neither interfere nor differ by a bit from the same call made alone.  (That two threads really run
in parallel is measured, not tested: benchmarks/bench_threads.py.)
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import fastattn

THREADS = 8


def _problem(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    sq, sk = int(rng.integers(1, 150)), int(rng.integers(1, 300))
    q = rng.standard_normal((2, 4, sq, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, sk, 32)).astype(np.float32) for _ in range(2))
    options = {"causal": "bottom_right", "key_lengths": rng.integers(0, sk + 1, size=2)}
    return {"q": q, "k": k, "v": v, "dout": rng.standard_normal(q.shape).astype(np.float32), "options": options}


def _forward_backward(problem: dict, backend: str) -> tuple[np.ndarray, ...]:
    q, k, v, options = problem["q"], problem["k"], problem["v"], problem["options"]
    out, lse = fastattn.attention(q, k, v, backend=backend, return_lse=True, **options)
    grads = fastattn.attention_backward(problem["dout"], q, k, v, out, lse, backend=backend, **options)
    return (out, lse, *grads)


@pytest.mark.parametrize("backend", [name for name, s in fastattn.backends.available().items() if s.available
                                     and "cpu" in fastattn.backends.get(name).devices])
def test_concurrent_calls_equal_lone_calls(backend: str) -> None:
    seeds = np.random.default_rng().integers(0, 2**31, size=THREADS * 3)
    problems = [_problem(int(seed)) for seed in seeds]
    alone = [_forward_backward(problem, backend) for problem in problems]
    together: list = [None] * len(problems)
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(worker: int) -> None:
        try:
            start.wait()
            for index in range(worker, len(problems), THREADS):
                together[index] = _forward_backward(problems[index], backend)
        except BaseException as error:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    assert not errors, errors
    for seed, lone, concurrent in zip(seeds, alone, together):
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), lone, concurrent):
            assert np.array_equal(a, b, equal_nan=True), f"{name} differs under concurrency (seed {seed})"
