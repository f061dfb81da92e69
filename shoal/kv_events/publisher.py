"""`ZmqEventPublisher`: an engine's KV-cache events over ZeroMQ, one message per engine step.

The engine's loop only hands a step's events to a queue (`publish`); a thread of this module
numbers, encodes and sends them, so a slow or absent subscriber never holds up a step. Each
message is three frames, as vLLM sends them: the topic, the batch's sequence number (8 bytes,
big-endian, signed) and the msgpack `KVEventBatch`. The last `buffer_steps` batches are kept:
a subscriber that sees a gap in the numbers asks the replay socket (ROUTER) for every batch
from a number on, sending that number as 8 bytes; the answer is one message per batch kept
(`[b"", seq, payload]` to a DEALER) and an end marker whose number is -1 and payload empty.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Protocol

import zmq

from shoal.kv_events.config import KVEventsConfig
from shoal.kv_events.events import KVEvent, KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_OF_REPLAY = -1
# How long the sending thread waits for a batch before it looks at the replay socket again.
_POLL_S = 0.02


class EventPublisher(Protocol):
    def publish(self, events: list[KVEvent]) -> None: ...

    def shutdown(self) -> None: ...


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self._context = zmq.Context()
        # Bound here, in the caller's thread, so that a bad endpoint fails the engine's start.
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._context.destroy(linger=0)
            raise ValueError(
                f"kv_events_config: cannot bind {config.endpoint} / {config.replay_endpoint}: {exc}"
            ) from exc
        self._thread = threading.Thread(target=self._run, name="shoal-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV-cache events on %s (topic %r)", config.endpoint, config.topic)

    @property
    def endpoint(self) -> str:
        """Where the PUB socket is bound, with the port ZeroMQ chose for a `tcp://...:*`."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (nothing when there are none); never blocks."""
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                logger.warning("KV-event queue full: dropping batches (subscribers see a gap)")

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()

    def _run(self) -> None:
        while True:
            try:
                batch = self._queue.get(timeout=_POLL_S)
                if batch is None:  # shutdown(): everything before it is sent
                    return
                self._send(batch)
            except queue.Empty:
                pass
            self._answer_replays()

    def _send(self, batch: KVEventBatch) -> None:
        seq, payload = self._next_seq, encode_batch(batch)
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)

    def _answer_replays(self) -> None:
        replay = self._replay
        while replay is not None and replay.poll(0):
            frames = replay.recv_multipart()
            client, start = frames[0], int.from_bytes(frames[-1], "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    replay.send_multipart((client, b"", seq_bytes(seq), payload))
            replay.send_multipart((client, b"", seq_bytes(END_OF_REPLAY), b""))


def make_event_publisher(config: KVEventsConfig | None) -> EventPublisher | None:
    """The publisher `config` asks for; None when events are off or go nowhere ("null"), and
    then the KV manager collects none."""
    if config is None or not config.enabled:
        return None
    return ZmqEventPublisher(config)
