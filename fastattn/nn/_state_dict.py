"""The two state-dict dialects an attention layer reads and writes.

``"llama"`` (Hugging Face Llama, Mistral, Qwen; the layer's own parameter names)::

    q_proj.weight (Hq*D, E)   k_proj.weight (Hkv*D, E)   v_proj.weight (Hkv*D, E)   o_proj.weight (E, Hq*D)
    q_proj.bias   (Hq*D,)     k_proj.bias   (Hkv*D,)     v_proj.bias   (Hkv*D,)     o_proj.bias   (E,)

``"torch"`` (torch.nn.MultiheadAttention, which has no grouped-query attention, so Hkv = Hq)::

    in_proj_weight (3E, E) = [q; k; v] rows    in_proj_bias (3E,)
    out_proj.weight (E, E)                     out_proj.bias (E,)

Weights are ``(out_features, in_features)`` in both, as in ``torch.nn.Linear``: ``y = x @ W.T + b``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

DIALECTS: tuple[str, ...] = ("llama", "torch")

_TORCH_RENAMES = {"out_proj.weight": "o_proj.weight", "out_proj.bias": "o_proj.bias"}
_IN_PROJ = {"in_proj_weight": "weight", "in_proj_bias": "bias"}


def detect_dialect(keys: Iterable[str]) -> str:
    """Return ``"torch"`` or ``"llama"`` from a state dict's keys, or raise ValueError."""
    names = sorted(keys)
    if "in_proj_weight" in names or "out_proj.weight" in names:
        return "torch"
    if any(name.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj") for name in names):
        return "llama"
    raise ValueError(
        "state_dict: expected the keys of torch.nn.MultiheadAttention (in_proj_weight, in_proj_bias, "
        "out_proj.weight, out_proj.bias) or Llama-style keys (q_proj.weight, k_proj.weight, "
        f"v_proj.weight, o_proj.weight, optional biases), received {names}"
    )


def check_dialect(dialect: Any) -> str:
    """Return ``dialect`` if it is one of :data:`DIALECTS`."""
    if dialect not in DIALECTS:
        raise ValueError(f"dialect: expected one of {list(DIALECTS)}, received {dialect!r}")
    return str(dialect)


def to_layer_names(state: Mapping[str, Any], dialect: str, rows: tuple[int, int, int]) -> dict[str, Any]:
    """Rename a state dict of native arrays to the layer's (Llama) names.

    The torch dialect's ``in_proj_*`` are split into q, k and v row blocks of sizes ``rows``
    (views, no copies); keys the dialect does not know pass through unchanged, for the caller to
    report as unexpected.
    """
    if dialect == "llama":
        return dict(state)
    renamed: dict[str, Any] = {}
    for key, value in state.items():
        if key in _IN_PROJ:
            total = sum(rows)
            if value.ndim < 1 or value.shape[0] != total:
                raise ValueError(
                    f"state_dict[{key!r}]: expected {total} rows (q, k and v stacked: "
                    f"{' + '.join(map(str, rows))}), received shape {tuple(value.shape)}"
                )
            start = 0
            for projection, size in zip(("q_proj", "k_proj", "v_proj"), rows):
                renamed[f"{projection}.{_IN_PROJ[key]}"] = value[start : start + size]
                start += size
        else:
            renamed[_TORCH_RENAMES.get(key, key)] = value
    return renamed


def from_layer_names(xp: ModuleType, params: Mapping[str, Any], dialect: str) -> dict[str, Any]:
    """Return copies of a layer's parameters (Llama names) under ``dialect``'s names."""
    if dialect == "llama":
        return {name: value.copy() for name, value in params.items()}
    state = {}
    for key, suffix in _IN_PROJ.items():
        parts = [params.get(f"{projection}.{suffix}") for projection in ("q_proj", "k_proj", "v_proj")]
        if parts[0] is not None:
            state[key] = xp.concatenate(parts)
    for key, name in _TORCH_RENAMES.items():
        if name in params:
            state[key] = params[name].copy()
    return state
