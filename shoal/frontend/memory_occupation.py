"""The frontend's plan of `release_memory_occupation` (SGLang's spelling of `sleep`, declared in
shoal/rl_verbs.py): shoal sleeps whole, so releasing some parts is a sleep and a wake-up of the
others.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

# SGLang's memory tags; "cuda_graph" names nothing shoal keeps asleep (graphs are captured again).
SGLANG_TAGS = ("weights", "kv_cache", "cuda_graph")
_SLEEP_TAGS = ("weights", "kv_cache")


def release_calls(tags: list[str] | None = None) -> Generator[tuple[str, tuple[Any, ...]], Any, None]:
    """`sleep(level=1)` (the weights keep a host copy, as SGLang's release may discard them),
    then `wake_up` of the parts `tags` leaves out; nothing when it names none of them."""
    named = list(SGLANG_TAGS) if tags is None else list(tags)
    unknown = sorted(set(named) - set(SGLANG_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; the tags are {list(SGLANG_TAGS)}")
    released = [tag for tag in _SLEEP_TAGS if tag in named]
    if not released:
        return
    yield "sleep", (1,)
    kept = [tag for tag in _SLEEP_TAGS if tag not in released]
    if kept:
        yield "wake_up", (kept,)
