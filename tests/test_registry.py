"""The backend registry: available(), explain(), selection order, third-party backends.

DESIGN.md §2: selection order is ``backend=`` argument > ``with fastattn.use_backend(name)`` >
``FASTATTN_BACKEND`` env var > automatic (fastest capable backend on the inputs' device); every
refusal has a readable reason; a backend that fails to import is registered as unavailable with its
import error as the reason and never breaks ``import fastattn``; third parties can ``register()``.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import fastattn
from fastattn import backends

B, HQ, HKV, SQ, SK, D, DV = 1, 4, 2, 3, 6, 8, 5
ENV = "FASTATTN_BACKEND"


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)


def _qkv(seed: int = 0, dtype: Any = np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, HQ, SQ, D)).astype(dtype),
        rng.standard_normal((B, HKV, SK, D)).astype(dtype),
        rng.standard_normal((B, HKV, SK, DV)).astype(dtype),
    )


_REFERENCE = backends.get("reference")


class ToyBackend:
    """A third-party backend that delegates to the reference and records its calls."""

    def __init__(
        self,
        name: str,
        priority: int = -100,
        devices: tuple[str, ...] = ("cpu",),
        decline: Callable[[Any], list[str]] | None = None,
    ) -> None:
        self.name = name
        self.priority = priority
        self.devices = devices
        self.decline = decline
        self.calls: list[str] = []
        self.asked: int = 0
        self._reference = _REFERENCE

    def not_supported_reasons(self, problem: Any) -> list[str]:
        self.asked += 1
        return list(self.decline(problem)) if self.decline else []

    def forward(self, problem: Any, q: Any, k: Any, v: Any, extras: Any) -> tuple[Any, Any]:
        assert problem.direction == "forward"
        self.calls.append("forward")
        return self._reference.forward(problem, q, k, v, extras)

    def backward(
        self, problem: Any, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, extras: Any
    ) -> tuple[Any, Any, Any]:
        assert problem.direction == "backward"
        self.calls.append("backward")
        return self._reference.backward(problem, dout, q, k, v, out, lse, extras)


@pytest.fixture
def toy() -> Iterator[Callable[..., ToyBackend]]:
    """Register toy backends for one test; they are unregistered afterwards whatever happens."""
    registered: list[str] = []

    def add(name: str, **options: Any) -> ToyBackend:
        backend = ToyBackend(name, **options)
        backends.register(backend)
        registered.append(name)
        return backend

    yield add
    for name in registered:
        backends.unregister(name)
    assert not set(registered) & set(backends.names())


@pytest.fixture
def unavailable_name() -> Iterator[str]:
    name = "toy_missing"
    yield name
    backends.unregister(name)


def _forward_and_backward(**options: Any) -> None:
    q, k, v = _qkv()
    out, lse = fastattn.attention(q, k, v, return_lse=True, **options)
    fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse, **options)


# --------------------------------------------------------------------------------------------------
# available()


def test_available_lists_builtin_backends() -> None:
    statuses = backends.available()
    assert statuses["reference"].available is True
    assert statuses["cpu"].available is True, statuses["cpu"]
    assert "cuda" in statuses
    for name, status in statuses.items():
        assert status.name == name
        assert isinstance(status, backends.BackendStatus)
    assert set(statuses) == set(backends.names())


def test_cuda_unavailable_without_cupy() -> None:
    try:
        importlib.import_module("cupy")
    except ImportError:
        pass
    else:
        pytest.skip("cupy imports here")
    status = backends.available()["cuda"]
    assert status.available is False
    assert status.detail.strip()
    assert "cupy" in status.detail.lower()
    assert "unavailable" in repr(status)
    with pytest.raises(fastattn.UnsupportedError) as info:
        backends.get("cuda")
    assert info.value.reasons == [status.detail]


def test_available_orders_by_priority(toy: Callable[..., ToyBackend]) -> None:
    toy("toy_top", priority=10_000)
    toy("toy_bottom", priority=-10_000)
    statuses = list(backends.available().values())
    usable = [s.name for s in statuses if s.available]
    unusable = [s.name for s in statuses if not s.available]
    assert [s.name for s in statuses] == usable + unusable
    assert usable[0] == "toy_top" and usable[-1] == "toy_bottom"
    priorities = [backends.get(name).priority for name in usable]
    assert priorities == sorted(priorities, reverse=True)


def test_builtin_backends_satisfy_protocol() -> None:
    for name, status in backends.available().items():
        if status.available:
            backend = backends.get(name)
            assert isinstance(backend, backends.Backend)
            assert backend.name == name


# --------------------------------------------------------------------------------------------------
# explain()


def test_explain_bottom_right_chooses_an_accepting_backend() -> None:
    q, k, v = _qkv()
    explanation = fastattn.explain(q, k, v, causal="bottom_right")
    assert explanation.chosen is not None
    assert set(explanation.reasons) == set(backends.names())
    assert explanation.reasons[explanation.chosen] == []
    chosen_priority = backends.get(explanation.chosen).priority
    for name, reasons in explanation.reasons.items():
        if name == explanation.chosen:
            continue
        assert reasons or backends.get(name).priority <= chosen_priority, name
    assert explanation.source == "automatic selection"
    assert explanation.problem.causal == "bottom_right"
    assert explanation.chosen_backward is not None

    report = str(explanation)
    assert explanation.chosen in report
    assert "bottom_right" in report
    declining = {name: reasons for name, reasons in explanation.reasons.items() if reasons}
    assert declining, "expected at least one declining backend (cpu and cuda today)"
    for name, reasons in declining.items():
        assert name in report
        for reason in reasons:
            assert reason in report


def test_explain_does_not_run_anything(toy: Callable[..., ToyBackend]) -> None:
    top = toy("toy_top", priority=10_000)
    q, k, v = _qkv()
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen == "toy_top" and explanation.chosen_backward == "toy_top"
    assert top.calls == [] and top.asked > 0


def test_explain_chosen_matches_what_runs(toy: Callable[..., ToyBackend]) -> None:
    q, k, v = _qkv()
    explanation = fastattn.explain(q, k, v, window=(1, 0))
    runner = toy("toy_runner", priority=-100)
    fastattn.attention(q, k, v, window=(1, 0), backend="toy_runner")
    assert runner.calls == ["forward"]
    assert explanation.chosen in [s for s, st in backends.available().items() if st.available]


# --------------------------------------------------------------------------------------------------
# selection order


def _calls(*toys: ToyBackend) -> list[list[str]]:
    return [list(t.calls) for t in toys]


def test_selection_order(toy: Callable[..., ToyBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    arg, ctx, env = toy("toy_arg"), toy("toy_ctx"), toy("toy_env")
    q, k, v = _qkv()

    # automatic: the low-priority toys are not picked
    _forward_and_backward()
    assert _calls(arg, ctx, env) == [[], [], []]
    assert fastattn.explain(q, k, v).chosen not in ("toy_arg", "toy_ctx", "toy_env")

    monkeypatch.setenv(ENV, "toy_env")
    _forward_and_backward()
    assert _calls(arg, ctx, env) == [[], [], ["forward", "backward"]]
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen == "toy_env" and ENV in explanation.source

    with fastattn.use_backend("toy_ctx"):
        _forward_and_backward()
        assert _calls(arg, ctx, env) == [[], ["forward", "backward"], ["forward", "backward"]]
        explanation = fastattn.explain(q, k, v)
        assert explanation.chosen == "toy_ctx" and "use_backend" in explanation.source

        _forward_and_backward(backend="toy_arg")
        assert _calls(arg, ctx, env) == [["forward", "backward"], ["forward", "backward"], ["forward", "backward"]]
        explanation = fastattn.explain(q, k, v, backend="toy_arg")
        assert explanation.chosen == "toy_arg" and "backend=" in explanation.source

    # the context is gone, the environment still applies
    fastattn.attention(q, k, v)
    assert env.calls == ["forward", "backward", "forward"]
    monkeypatch.delenv(ENV)
    fastattn.attention(q, k, v)
    assert _calls(arg, ctx, env) == [
        ["forward", "backward"],
        ["forward", "backward"],
        ["forward", "backward", "forward"],
    ]


def test_explicit_choice_results_equal_reference(toy: Callable[..., ToyBackend]) -> None:
    toy("toy_same")
    q, k, v = _qkv(3, np.float64)
    got = fastattn.attention(q, k, v, causal=True, backend="toy_same", return_lse=True)
    want = fastattn.attention(q, k, v, causal=True, backend="reference", return_lse=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_sdpa_uses_selection(toy: Callable[..., ToyBackend]) -> None:
    chosen = toy("toy_sdpa")
    q, k, v = _qkv()
    with fastattn.use_backend("toy_sdpa"):
        fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert chosen.calls == ["forward"]


def test_empty_env_variable_means_automatic(toy: Callable[..., ToyBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    low = toy("toy_low")
    monkeypatch.setenv(ENV, "  ")
    q, k, v = _qkv()
    explanation = fastattn.explain(q, k, v)
    assert explanation.source == "automatic selection"
    fastattn.attention(q, k, v)
    assert low.calls == []


def test_env_variable_naming_unknown_backend_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "no_such_backend")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="no_such_backend"):
        fastattn.attention(q, k, v)


def test_env_variable_naming_a_declining_backend_does_not_fall_back(
    toy: Callable[..., ToyBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = "toy_never declines everything"
    toy("toy_never", priority=10_000, decline=lambda p: [reason])
    q, k, v = _qkv()
    monkeypatch.setenv(ENV, "toy_never")
    with pytest.raises(fastattn.UnsupportedError) as info:
        fastattn.attention(q, k, v)
    assert info.value.reasons == [reason]
    assert ENV in str(info.value)
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen is None and ENV in explanation.source


def test_higher_priority_third_party_backend_is_chosen_automatically(toy: Callable[..., ToyBackend]) -> None:
    top = toy("toy_fast", priority=10_000)
    q, k, v = _qkv()
    _forward_and_backward()
    assert top.calls == ["forward", "backward"]
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen == "toy_fast"
    report = str(explanation)
    assert "toy_fast" in report
    reference_lines = [line for line in report.splitlines() if line.strip().startswith("reference")]
    assert reference_lines and all("lower priority" in line for line in reference_lines), report


def test_declining_backend(toy: Callable[..., ToyBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    reason = "toy_picky does not do softcap"
    picky = toy("toy_picky", priority=10_000, decline=lambda p: [reason] if p.softcap is not None else [])
    q, k, v = _qkv()

    # automatic: declines softcap, so something else runs it, and explain says why
    out = fastattn.attention(q, k, v, softcap=5.0)
    assert picky.calls == []
    explanation = fastattn.explain(q, k, v, softcap=5.0)
    assert explanation.chosen not in (None, "toy_picky")
    np.testing.assert_array_equal(out, fastattn.attention(q, k, v, softcap=5.0, backend=explanation.chosen))
    assert explanation.reasons["toy_picky"] == [reason]
    assert reason in str(explanation)

    # explicit requests raise, listing the reason, whichever way they are made
    for how in ("argument", "context", "env"):
        with pytest.raises(fastattn.UnsupportedError) as info:
            if how == "argument":
                fastattn.attention(q, k, v, softcap=5.0, backend="toy_picky")
            elif how == "context":
                with fastattn.use_backend("toy_picky"):
                    fastattn.attention(q, k, v, softcap=5.0)
            else:
                monkeypatch.setenv(ENV, "toy_picky")
                fastattn.attention(q, k, v, softcap=5.0)
        assert info.value.reasons == [reason], how
        assert reason in str(info.value) and "toy_picky" in str(info.value)
        monkeypatch.delenv(ENV, raising=False)
    assert picky.calls == []

    # without softcap it accepts and, having the highest priority, runs
    fastattn.attention(q, k, v)
    assert picky.calls == ["forward"]


def test_backend_for_another_device_declines_with_device_reason(toy: Callable[..., ToyBackend]) -> None:
    toy("toy_gpu_only", priority=10_000, devices=("cuda",))
    q, k, v = _qkv()
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen != "toy_gpu_only"
    (reason,) = explanation.reasons["toy_gpu_only"]
    assert "cuda" in reason and "cpu" in reason
    with pytest.raises(fastattn.UnsupportedError) as info:
        fastattn.attention(q, k, v, backend="toy_gpu_only")
    assert info.value.reasons == [reason]


def test_no_backend_accepts(toy: Callable[..., ToyBackend], monkeypatch: pytest.MonkeyPatch) -> None:
    """Automatic selection with every backend declining raises, listing each one's reasons."""
    saved = {name: backends.get(name) for name, st in backends.available().items() if st.available}
    try:
        for name in saved:
            backends.unregister(name)
        toy("toy_never", decline=lambda p: ["toy_never never runs anything"])
        q, k, v = _qkv()
        with pytest.raises(fastattn.UnsupportedError) as info:
            fastattn.attention(q, k, v)
        assert info.value.reasons == ["toy_never: toy_never never runs anything"]
        assert fastattn.explain(q, k, v).chosen is None
    finally:
        for backend in saved.values():
            backends.register(backend, replace=True)
    assert fastattn.explain(*_qkv()).chosen is not None


# --------------------------------------------------------------------------------------------------
# register / unregister / register_unavailable


class _MissingBackward:
    name = "toy_incomplete"
    devices = ("cpu",)
    priority = 0

    def not_supported_reasons(self, problem: Any) -> list[str]:
        return []

    def forward(self, problem: Any, q: Any, k: Any, v: Any, extras: Any) -> Any:
        raise AssertionError("never called")


@pytest.mark.parametrize(
    "candidate", [object(), "reference", _MissingBackward(), ToyBackend], ids=["object", "str", "no-backward", "class"]
)
def test_register_rejects_non_backends(candidate: Any) -> None:
    before = backends.names()
    with pytest.raises(TypeError, match=r"^backend:"):
        backends.register(candidate)
    assert backends.names() == before


def test_register_duplicate_name(toy: Callable[..., ToyBackend]) -> None:
    first = toy("toy_dup")
    second = ToyBackend("toy_dup")
    with pytest.raises(ValueError, match=r"^backend:.*toy_dup"):
        backends.register(second)
    assert backends.get("toy_dup") is first
    with pytest.raises(ValueError, match=r"^backend:"):
        backends.register(ToyBackend("reference"))
    assert backends.get("reference") is not None and not isinstance(backends.get("reference"), ToyBackend)

    backends.register(second, replace=True)
    assert backends.get("toy_dup") is second
    fastattn.attention(*_qkv(), backend="toy_dup")
    assert first.calls == [] and second.calls == ["forward"]


def test_unregister_removes(toy: Callable[..., ToyBackend]) -> None:
    toy("toy_gone")
    assert "toy_gone" in backends.available()
    backends.unregister("toy_gone")
    assert "toy_gone" not in backends.available()
    with pytest.raises(ValueError, match=r"^backend:"):
        fastattn.attention(*_qkv(), backend="toy_gone")
    backends.unregister("toy_gone")  # removing twice is harmless


def test_register_unavailable(unavailable_name: str) -> None:
    reason = "libtoy.so: cannot open shared object file"
    backends.register_unavailable(unavailable_name, reason)
    status = backends.available()[unavailable_name]
    assert status.available is False and status.detail == reason
    assert unavailable_name in backends.names()
    q, k, v = _qkv()
    with pytest.raises(fastattn.UnsupportedError) as info:
        fastattn.attention(q, k, v, backend=unavailable_name)
    assert info.value.reasons == [reason]
    with fastattn.use_backend(unavailable_name):
        with pytest.raises(fastattn.UnsupportedError) as info:
            fastattn.attention(q, k, v)
    assert info.value.reasons == [reason]
    explanation = fastattn.explain(q, k, v)
    assert explanation.chosen != unavailable_name
    assert any(reason in line for line in explanation.reasons[unavailable_name])
    assert reason in str(explanation)


def test_register_replaces_an_unavailable_entry(unavailable_name: str) -> None:
    backends.register_unavailable(unavailable_name, "not built")
    backend = ToyBackend(unavailable_name)
    backends.register(backend)
    assert backends.available()[unavailable_name].available is True
    fastattn.attention(*_qkv(), backend=unavailable_name)
    assert backend.calls == ["forward"]
    backends.register_unavailable(unavailable_name, "ignored: it is registered")
    assert backends.available()[unavailable_name].available is True


# --------------------------------------------------------------------------------------------------
# use_backend scoping


def test_use_backend_restored_after_exception(toy: Callable[..., ToyBackend]) -> None:
    scoped = toy("toy_scoped")
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="boom"):
        with fastattn.use_backend("toy_scoped"):
            assert fastattn.explain(q, k, v).chosen == "toy_scoped"
            raise RuntimeError("boom")
    explanation = fastattn.explain(q, k, v)
    assert explanation.source == "automatic selection"
    assert explanation.chosen != "toy_scoped"
    fastattn.attention(q, k, v)
    assert scoped.calls == []


def test_use_backend_nesting_and_none(toy: Callable[..., ToyBackend]) -> None:
    outer, inner = toy("toy_outer"), toy("toy_inner")
    q, k, v = _qkv()
    with fastattn.use_backend("toy_outer"):
        with fastattn.use_backend("toy_inner"):
            fastattn.attention(q, k, v)
        fastattn.attention(q, k, v)
        with fastattn.use_backend(None):
            assert fastattn.explain(q, k, v).source == "automatic selection"
            fastattn.attention(q, k, v)
    assert inner.calls == ["forward"]
    assert outer.calls == ["forward"]


def test_use_backend_is_local_to_a_thread(toy: Callable[..., ToyBackend]) -> None:
    toy("toy_threaded")
    q, k, v = _qkv()
    entered, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def worker() -> None:
        with fastattn.use_backend("toy_threaded"):
            seen["worker"] = fastattn.explain(q, k, v).chosen
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(10)
        seen["main"] = fastattn.explain(q, k, v).chosen
    finally:
        release.set()
        thread.join(10)
    assert seen["worker"] == "toy_threaded"
    assert seen["main"] != "toy_threaded"


# --------------------------------------------------------------------------------------------------
# a backend whose import fails does not break `import fastattn`

_BROKEN_IMPORT = r"""
import json, sys
sys.modules["fastattn._cpu._runtime"] = None  # any import of the extension now raises ImportError
import numpy as np
import fastattn

status = fastattn.backends.available()["cpu"]
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
out = fastattn.attention(q, q, q)
try:
    fastattn.attention(q, q, q, backend="cpu")
except fastattn.UnsupportedError as error:
    explicit = error.reasons
else:
    explicit = None
print(json.dumps({
    "file": fastattn.__file__,
    "available": status.available,
    "detail": status.detail,
    "shape": list(out.shape),
    "finite": bool(np.isfinite(out).all()),
    "chosen": fastattn.explain(q, q, q).chosen,
    "explicit": explicit,
}))
"""


def test_import_survives_a_broken_cpu_extension() -> None:
    env = {key: value for key, value in os.environ.items() if key != ENV}
    result = subprocess.run(
        [sys.executable, "-c", _BROKEN_IMPORT], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["file"] == fastattn.__file__
    assert report["available"] is False
    assert "extension" in report["detail"]
    assert "fastattn._cpu" in report["detail"]
    assert report["shape"] == [1, 2, 3, 4] and report["finite"]
    assert report["chosen"] == "reference"
    assert report["explicit"] == [report["detail"]]


class _OddBackend:
    def __init__(self, name: Any, priority: Any) -> None:
        self.name = name
        self.priority = priority
        self.devices = ("cpu",)

    def not_supported_reasons(self, problem: Any) -> list[str]:
        return []

    def forward(self, problem: Any, q: Any, k: Any, v: Any, extras: Any) -> Any:
        return _REFERENCE.forward(problem, q, k, v, extras)

    def backward(self, *args: Any) -> Any:
        return _REFERENCE.backward(*args)


@pytest.mark.parametrize(("name", "priority"), [(3, 0), ("toy_no_priority", None)], ids=["int-name", "None-priority"])
def test_register_rejects_malformed_backends(name: Any, priority: Any) -> None:
    q, k, v = _qkv()
    try:
        with pytest.raises(TypeError, match=r"^backend:"):
            backends.register(_OddBackend(name, priority))
    finally:
        backends.unregister(name)
    assert fastattn.explain(q, k, v).chosen is not None
