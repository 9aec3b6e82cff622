"""The backend registry: the Backend protocol, registration, selection and ``explain``.

Every backend declares what it can run by returning the reasons it cannot
(``not_supported_reasons``); an empty list means it will run the problem.  Selection order:
the ``backend=`` argument, then ``with use_backend(name)``, then the ``FASTATTN_BACKEND``
environment variable, then automatic (the highest-priority available backend that serves the
inputs' device and accepts the problem).  A backend named in any of the first three ways that
cannot run the problem raises :class:`UnsupportedError` listing its reasons; nothing falls back
silently.  A backend whose module fails to import is registered as unavailable with the error as
its reason, so ``import fastattn`` never breaks.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .._problem import AttentionExtras, AttentionProblem

ENV_VARIABLE = "FASTATTN_BACKEND"
# The variable is read on every call (it may change at run time).  ``os.environ.get`` costs about
# 0.6 us when the variable is unset (a KeyError raised and caught inside the mapping); CPython's
# environ keeps its encoded entries in ``_data``, which is read directly where it exists.
_ENVIRON_DATA: dict[Any, Any] | None = getattr(os.environ, "_data", None)
_ENVIRON_KEY: Any = getattr(os.environ, "encodekey", lambda key: key)(ENV_VARIABLE)


def _environment_request() -> str:
    """The stripped value of ``FASTATTN_BACKEND`` ("" when unset)."""
    if _ENVIRON_DATA is None:
        return os.environ.get(ENV_VARIABLE, "").strip()
    value = _ENVIRON_DATA.get(_ENVIRON_KEY)
    return "" if value is None else str(os.environ.decodevalue(value)).strip()


class UnsupportedError(RuntimeError):
    """A requested backend cannot run the problem; ``reasons`` says why, one line each."""

    def __init__(self, message: str, reasons: list[str] | None = None) -> None:
        self.reasons = list(reasons or [])
        lines = [message] + [f"  - {reason}" for reason in self.reasons]
        super().__init__("\n".join(lines))


@runtime_checkable
class Backend(Protocol):
    """What a backend provides.

    Attributes
    ----------
    name : str
        Registry key (``"reference"``, ``"cpu"``, ``"cuda"``, ...).
    devices : tuple of str
        Devices whose arrays it takes (``"cpu"``, ``"cuda"``).
    priority : int
        Higher is preferred by automatic selection.
    """

    name: str
    devices: tuple[str, ...]
    priority: int

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        """Return why this backend cannot run ``problem``; empty when it can.

        A function of the problem alone: the registry remembers which backend a problem selected
        (until a backend is registered or removed).
        """
        ...

    def forward(
        self, problem: AttentionProblem, q: Any, k: Any, v: Any, extras: AttentionExtras
    ) -> tuple[Any, Any]:
        """Return ``(out, lse)``: out ``(B, Hq, Sq, Dv)`` in q's dtype, lse ``(B, Hq, Sq)``."""
        ...

    def backward(
        self,
        problem: AttentionProblem,
        dout: Any,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        extras: AttentionExtras,
    ) -> tuple[Any, Any, Any]:
        """Return ``(dq, dk, dv)`` in the shapes and dtypes of q, k, v."""
        ...


@dataclass(frozen=True)
class BackendStatus:
    """Whether a registered backend can be used at all, and a line about it."""

    name: str
    available: bool
    detail: str

    def __repr__(self) -> str:
        state = "available" if self.available else "unavailable"
        return f"{state}: {self.detail}" if self.detail else state


@dataclass
class _Registry:
    backends: dict[str, Backend] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    #: (problem, requested name or None) -> the backend select() chose; emptied on every change.
    # Keyed by the problem's identity (validation hands out one object per distinct problem): hashing
    # a problem is a Python call, an id is not.  The entry holds the problem, which keeps its id
    # from being reused while the entry lives, and is checked to be the same object.
    selected: dict[tuple[int, str | None], tuple[AttentionProblem, Backend]] = field(default_factory=dict)

    def changed(self) -> None:
        self.selected.clear()


_registry = _Registry()
_requested: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "fastattn_backend", default=None
)


def register(backend: Backend, *, replace: bool = False) -> None:
    """Add a backend to the registry.

    Parameters
    ----------
    backend : Backend
        An object with ``name``, ``devices``, ``priority``, ``not_supported_reasons``,
        ``forward`` and ``backward``.
    replace : bool
        Allow replacing a backend already registered under the same name.
    """
    if not isinstance(backend, Backend):
        raise TypeError(
            "backend: expected an object with name, devices, priority, not_supported_reasons, "
            f"forward and backward, received {type(backend).__name__}"
        )
    if not isinstance(backend.name, str) or not backend.name:
        raise TypeError(f"backend: expected a non-empty str name, received {backend.name!r}")
    if isinstance(backend.priority, bool) or not isinstance(backend.priority, int):
        raise TypeError(f"backend: expected an int priority, received {backend.priority!r}")
    if not isinstance(backend.devices, tuple) or not all(isinstance(d, str) for d in backend.devices):
        raise TypeError(f"backend: expected devices as a tuple of str, received {backend.devices!r}")
    if backend.name in _registry.backends and not replace:
        raise ValueError(f"backend: a backend named {backend.name!r} is already registered")
    _registry.unavailable.pop(backend.name, None)
    _registry.backends[backend.name] = backend
    _registry.changed()


def register_unavailable(name: str, reason: str) -> None:
    """Record a backend that could not be loaded, with the reason shown by ``available()``."""
    if name not in _registry.backends:
        _registry.unavailable[name] = reason
        _registry.changed()


def unregister(name: str) -> None:
    """Remove a backend (available or not) from the registry."""
    _registry.backends.pop(name, None)
    _registry.unavailable.pop(name, None)
    _registry.changed()


def names() -> list[str]:
    """Return every registered name, available or not."""
    return sorted(set(_registry.backends) | set(_registry.unavailable))


def is_registered(name: str) -> bool:
    """Whether ``name`` is registered, available or not."""
    return name in _registry.backends or name in _registry.unavailable


def get(name: str) -> Backend:
    """Return the backend registered as ``name``.

    Raises
    ------
    ValueError
        No backend of that name is registered.
    UnsupportedError
        It is registered but unavailable on this machine.
    """
    if name in _registry.backends:
        return _registry.backends[name]
    if name in _registry.unavailable:
        raise UnsupportedError(
            f"backend {name!r} is unavailable on this machine", [_registry.unavailable[name]]
        )
    raise ValueError(f"backend: expected one of {names()}, received {name!r}")


def available() -> dict[str, BackendStatus]:
    """Return every registered backend with whether it can be used here and why (not).

    Returns
    -------
    dict of str to BackendStatus
        Keyed by name, highest priority first among the available ones, then the unavailable.
    """
    statuses: dict[str, BackendStatus] = {}
    for backend in sorted(_registry.backends.values(), key=lambda b: -b.priority):
        detail = getattr(backend, "description", "")
        statuses[backend.name] = BackendStatus(backend.name, True, detail)
    for name, reason in sorted(_registry.unavailable.items()):
        statuses[name] = BackendStatus(name, False, reason)
    return statuses


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Run the calls inside the ``with`` block on the backend ``name`` (None: automatic).

    Context-local (``contextvars``), so threads and asyncio tasks each keep their own choice.
    """
    if name is not None:
        if not isinstance(name, str):
            raise TypeError(f"name: expected a backend name (str) or None, received {name!r}")
        if name not in names():
            raise ValueError(f"name: expected one of {names()}, received {name!r}")
    token = _requested.set(name)
    try:
        yield
    finally:
        _requested.reset(token)


def requested_backend(argument: str | None) -> tuple[str | None, str]:
    """Return the explicitly requested backend name, if any, and where the request came from."""
    if argument is not None:
        return argument, "the backend= argument"
    requested = _requested.get()
    if requested is not None:
        return requested, "use_backend()"
    from_env = _environment_request()
    if from_env:
        return from_env, f"the {ENV_VARIABLE} environment variable"
    return None, "automatic selection"


def _reasons(backend: Backend, problem: AttentionProblem) -> list[str]:
    if problem.device not in backend.devices:
        return [f"takes arrays on {', '.join(backend.devices)}, not {problem.device}"]
    return list(backend.not_supported_reasons(problem))


def select(problem: AttentionProblem, argument: str | None = None) -> Backend:
    """Return the backend that will run ``problem``.

    Raises
    ------
    UnsupportedError
        The requested backend cannot run it, or (automatic selection) none can.
    """
    name = argument
    if name is None:  # requested_backend's order, without building the source's words on every call
        name = _requested.get()
        if name is None:
            name = _environment_request() or None
    remembered = _registry.selected.get((id(problem), name))
    if remembered is not None and remembered[0] is problem:
        return remembered[1]
    name, source = requested_backend(argument)
    backend = _select(problem, name, source)
    if len(_registry.selected) >= _SELECTIONS_KEPT:
        _registry.selected.clear()
    _registry.selected[(id(problem), name)] = (problem, backend)
    return backend


#: How many (problem, request) selections are remembered before the memory starts afresh.
_SELECTIONS_KEPT = 1024


def _select(problem: AttentionProblem, name: str | None, source: str) -> Backend:
    if name is not None:
        backend = get(name)
        reasons = _reasons(backend, problem)
        if reasons:
            raise UnsupportedError(
                f"backend {name!r} (requested by {source}) cannot run this {problem.direction} "
                f"call: {problem.describe()}",
                reasons,
            )
        return backend
    declined: list[str] = []
    for backend in sorted(_registry.backends.values(), key=lambda b: -b.priority):
        reasons = _reasons(backend, problem)
        if not reasons:
            return backend
        declined.extend(f"{backend.name}: {reason}" for reason in reasons)
    raise UnsupportedError(f"no backend can run this call: {problem.describe()}", declined)


@dataclass(frozen=True)
class Explanation:
    """Which backend runs a call and why every other one declined; ``str()`` is the report.

    Attributes
    ----------
    problem : AttentionProblem
        The validated forward problem.
    chosen : str or None
        The backend that runs the forward pass (None when none can).
    chosen_backward : str or None
        The backend that runs the backward pass of the same call.
    source : str
        Where the choice came from (argument, ``use_backend``, environment, automatic).
    reasons : dict of str to list of str
        For every registered backend, why it declines the forward (empty list: it accepts).
    backward_reasons : dict of str to list of str
        The same for the backward pass of this call.
    kernels : tuple of str
        The kernels the chosen backend runs the forward on, where it names them (a backend with a
        ``kernels(problem)`` method: the cuda backends name their template instances); else empty.
    backward_kernels : tuple of str
        The same for the backward.
    """

    problem: AttentionProblem
    chosen: str | None
    chosen_backward: str | None
    source: str
    reasons: dict[str, list[str]]
    backward_reasons: dict[str, list[str]]
    kernels: tuple[str, ...] = ()
    backward_kernels: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [f"fastattn call: {self.problem.describe()}"]
        lines.append(f"forward runs on: {self.chosen or 'nothing (no backend accepts it)'} ({self.source})")
        lines.extend(f"  kernel: {name}" for name in self.kernels)
        lines.append(f"backward runs on: {self.chosen_backward or 'nothing (no backend accepts it)'}")
        lines.extend(f"  kernel: {name}" for name in self.backward_kernels)
        for name, reasons in self.reasons.items():
            if name != self.chosen:
                lines.extend(_declined_lines(name, reasons, "forward"))
        for name, reasons in self.backward_reasons.items():
            if name != self.chosen_backward and reasons != self.reasons[name]:
                lines.extend(_declined_lines(name, reasons, "backward"))
        return "\n".join(lines)


def _declined_lines(name: str, reasons: list[str], direction: str) -> list[str]:
    if not reasons:
        return [f"  {name}: could run the {direction}, but has lower priority"]
    return [f"  {name} declined the {direction}:"] + [f"    - {reason}" for reason in reasons]


def explain_problem(
    problem: AttentionProblem, backward_problem: AttentionProblem, argument: str | None = None
) -> Explanation:
    """Build the :class:`Explanation` for a forward problem and its backward twin."""
    _, source = requested_backend(argument)
    chosen, chosen_backward = _chosen_name(problem, argument), _chosen_name(backward_problem, argument)
    return Explanation(
        problem,
        chosen,
        chosen_backward,
        source,
        _all_reasons(problem),
        _all_reasons(backward_problem),
        _kernels(chosen, problem),
        _kernels(chosen_backward, backward_problem),
    )


def _kernels(name: str | None, problem: AttentionProblem) -> tuple[str, ...]:
    """The kernels backend ``name`` names for ``problem`` (its optional ``kernels`` method)."""
    describe = getattr(_registry.backends.get(name or ""), "kernels", None)
    return () if describe is None else tuple(describe(problem))


def _all_reasons(problem: AttentionProblem) -> dict[str, list[str]]:
    reasons: dict[str, list[str]] = {}
    for name in names():
        if name in _registry.unavailable:
            reasons[name] = [f"unavailable: {_registry.unavailable[name]}"]
        else:
            reasons[name] = _reasons(_registry.backends[name], problem)
    return reasons


def _chosen_name(problem: AttentionProblem, argument: str | None) -> str | None:
    try:
        return select(problem, argument).name
    except UnsupportedError:
        return None
