from typing import Any

from ._options import AttentionOptions

def call_key(
    direction: str,
    natives: dict[str, Any],
    origins: Any,
    options: AttentionOptions,
    deterministic: Any,
) -> tuple[Any, ...] | None: ...
