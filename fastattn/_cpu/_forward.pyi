from typing import Any

def forward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    scale: float,
    softcap: float,
    causal: bool,
    offset: int,
    window_left: int,
    window_right: int,
    mask: Any | None,
    key_lengths: Any | None,
    block_queries: int,
    key_tile: int,
    splits: int,
    threads: int,
) -> None: ...
