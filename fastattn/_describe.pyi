from typing import Any

from ._options import AttentionOptions

def call_key(
    direction: str,
    natives: dict[str, Any],
    origins: dict[str, Any] | None,
    options: AttentionOptions,
    deterministic: Any,
) -> tuple[Any, ...] | None: ...
