"""Two real processes: mpiexec (mpi4py, MPICH from its PyPI wheel) and torch.distributed (gloo).

Each run checks ring and Ulysses attention, forward and backward, against one process
(``_worker.py``); a run in which a rank fails must end with that rank's error, not hang.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = str(Path(__file__).with_name("_worker.py"))
#: Seconds a run may take before the test calls it hung (the communicators' own deadline is 30 s).
LIMIT = 120


def _missing(reason: str) -> None:
    """Skip where an engine is missing, but fail in CI, which installs the mpi extra for these tests."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run the real-process tests")
    pytest.skip(reason)


def _mpiexec() -> str:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        _missing("mpi4py is not installed (pip install -e '.[mpi]')")
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if found is None:
        _missing("mpiexec not found (pip install -e '.[mpi]' brings MPICH's)")
    assert found is not None
    return found


def _run_mpi(*arguments: str) -> subprocess.CompletedProcess[str]:
    command = [_mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", WORKER, "mpi", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, env=_environment())


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_torch(*arguments: str) -> list[subprocess.CompletedProcess[str]]:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        _missing("torch is not installed")
    port = str(_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, WORKER, "torch", *arguments],
            env={**_environment(), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_PORT": port},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for process in ranks:
        try:
            stdout, stderr = process.communicate(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
    return results


def test_mpi_two_ranks_equal_one_process() -> None:
    result = _run_mpi(str(secrets.randbits(32)))
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):  # (the ranks' lines may interleave)
        assert f"rank {rank} of 2 (mpi): ok" in result.stdout, result.stdout


def test_mpi_a_failing_rank_fails_the_run_with_its_error() -> None:
    start = time.monotonic()
    result = _run_mpi("1", "fail")
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stdout + result.stderr
    assert time.monotonic() - start < LIMIT


def test_torch_gloo_two_ranks_equal_one_process() -> None:
    results = _run_torch(str(secrets.randbits(32)))
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stdout}{result.stderr}"
        assert f"rank {rank} of 2 (torch): ok" in result.stdout


def test_torch_gloo_a_failing_rank_fails_the_run_with_its_error() -> None:
    results = _run_torch("1", "fail")
    assert results[1].returncode != 0 and "rank 1 fails on purpose" in results[1].stderr
    assert results[0].returncode != 0, results[0].stdout


def test_example_runs_under_mpiexec() -> None:
    example = str(Path(__file__).parents[2] / "examples" / "ring_attention.py")
    command = [_mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py", example, "--seq", "600", "--check"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=LIMIT, env=_environment())
    assert result.returncode == 0, result.stdout + result.stderr
    number = r"([0-9.e+-]+)"
    pattern = rf"rank (\d): largest difference [^:]*: {number}, {number}, {number}, {number}"
    differences = re.findall(pattern, result.stdout)
    assert sorted(found[0] for found in differences) == ["0", "1"], result.stdout
    for rank, *values in differences:
        assert all(float(value) < 1e-4 for value in values), (rank, values)
