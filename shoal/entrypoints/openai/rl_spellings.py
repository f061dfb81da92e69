"""Other frameworks' fields on shoal's RL routes: each function turns the fields of one of
SGLang's routes (python/sglang/srt/managers/io_struct.py) into the verb's parameters
(shoal/rl_verbs.py, a `Route`'s `rewrite`), and refuses, with a ValueError that says why, a
value shoal cannot honour rather than ignore it.
"""

from __future__ import annotations

from typing import Any

from shoal.engine_core.generation_control import SGLANG_MEMORY_TAGS as SGLANG_TAGS

# SGLang's pause modes as shoal's: "retract" recomputes the kept requests' KV cache after the
# resume, "in_place" keeps it.
_PAUSE_MODES = {
    "abort": {"mode": "abort"},
    "retract": {"mode": "keep", "clear_cache": True},
    "in_place": {"mode": "keep", "clear_cache": False},
}
# Checkpoint formats an update from disk can read (safetensors folders, as at start-up).
_DISK_FORMATS = (None, "auto", "safetensors")
SGLANG_GROUP_NAME = "weight_update_group"  # SGLang's default group name


def pause_mode(fields: dict[str, Any]) -> dict[str, Any]:
    """`/pause_generation {mode: abort | retract | in_place}` (default abort)."""
    mode = fields.pop("mode", None) or "abort"
    if mode not in _PAUSE_MODES:
        raise ValueError(f"mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}")
    return {**fields, **_PAUSE_MODES[mode]}


def memory_tags(fields: dict[str, Any]) -> dict[str, Any]:
    """`/release_memory_occupation` and `/resume_memory_occupation {tags}`: SGLang's tags,
    "cuda_graph" dropped on resume (shoal captures graphs again by itself)."""
    tags = fields.get("tags")
    if tags is None:
        return fields
    if isinstance(tags, str):
        tags = [tags]
    if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
        raise ValueError("tags must be a list of strings")
    unknown = sorted(set(tags) - set(SGLANG_TAGS))
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; the tags are {list(SGLANG_TAGS)}")
    return {**fields, "tags": tags}


def resume_tags(fields: dict[str, Any]) -> dict[str, Any]:
    fields = memory_tags(fields)
    if fields.get("tags") is not None:
        fields["tags"] = [tag for tag in fields["tags"] if tag != "cuda_graph"]
    return fields


def weight_update(fields: dict[str, Any]) -> dict[str, Any]:
    """The update routes' SGLang fields: `flush_cache` is `reset_prefix_cache`; `load_format`
    must be one shoal reads the same way."""
    if "flush_cache" in fields:
        fields["reset_prefix_cache"] = fields.pop("flush_cache")
    load_format = fields.pop("load_format", None)
    if "names" in fields and load_format is not None:
        raise ValueError(
            f"load_format {load_format!r} is not supported for a distributed update: broadcast each tensor "
            "whole (load_format null)"
        )
    if load_format not in _DISK_FORMATS:
        raise ValueError(
            f"load_format must be one of {list(_DISK_FORMATS)} (a safetensors folder), got {load_format!r}"
        )
    fields.pop("group_name", None)  # the group this engine joined (one at a time)
    return fields


def weights_update_group(fields: dict[str, Any]) -> dict[str, Any]:
    """`/init_weights_update_group`: SGLang's trainers build a torch process group named
    `group_name` (default "weight_update_group")."""
    return {**fields, "group_name": fields.get("group_name") or SGLANG_GROUP_NAME}
