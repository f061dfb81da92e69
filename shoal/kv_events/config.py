"""`KVEventsConfig`: whether and where an engine publishes its KV-cache events, with vLLM's
field names (`--kv-events-config '<json>'`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    # "zmq": a ZeroMQ PUB socket; "null": collect nothing, publish nothing.
    publisher: str = "zmq"
    # The PUB socket binds here (tcp://*:5557, ipc://...); subscribers connect to it.
    endpoint: str = "tcp://*:5557"
    # A ROUTER socket answering "every batch from sequence number N" (None: no replay).
    replay_endpoint: str | None = None
    topic: str = ""
    # Batches kept for replay.
    buffer_steps: int = 10_000
    # ZeroMQ's send high-water mark: messages queued per subscriber before dropping.
    hwm: int = 100_000
    # Batches waiting for the publisher's thread before the engine drops the newest.
    max_queue_size: int = 100_000

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """The config from a JSON object, a dict or itself; every bad field is a `ValueError`."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has unknown fields {unknown}; known: {sorted(known)}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS}, got {self.publisher!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be a positive integer")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZeroMQ address, got {self.endpoint!r}")
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config.topic must be a string")
