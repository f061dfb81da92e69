"""`EventSubscriber`: reads one engine's KV-cache events (a ZeroMQ SUB socket, a thread of
its own) and hands each batch to a callback in sequence order.

A gap in the sequence numbers (messages dropped at the high-water mark, or a subscriber that
joined after the first batch) is filled from the publisher's replay socket when it has one;
otherwise `on_gap` is called, and a router then forgets what it knew of that engine. Numbers
that start again from below (a new engine on the same endpoint) call `on_gap` too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq

from shoal.kv_events.events import KVEventBatch, decode_batch
from shoal.kv_events.publisher import END_OF_REPLAY, seq_bytes

logger = logging.getLogger(__name__)

_POLL_MS = 50
_REPLAY_TIMEOUT_MS = 1000


class EventSubscriber:
    def __init__(
        self,
        endpoint: str,
        on_batch: Callable[[int, KVEventBatch], None],
        topic: str = "",
        replay_endpoint: str | None = None,
        on_gap: Callable[[], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._on_batch = on_batch
        self._on_gap = on_gap
        self._topic = topic.encode()
        # The publisher numbers its batches from 0.
        self.last_seq = -1
        self._context = zmq.Context()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shoal-kv-sub-{endpoint}", daemon=True)
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._context.term()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sub.poll(_POLL_MS):
                    continue
                _, seq_frame, payload = self._sub.recv_multipart()
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if seq > self.last_seq + 1:
                    self._fill_gap(self.last_seq + 1, seq)
                elif seq <= self.last_seq and self._on_gap is not None:
                    self._on_gap()  # a new publisher
                self._deliver(seq, payload)
        finally:
            self._sub.close()

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            self._on_batch(seq, decode_batch(payload))
        except Exception:  # one bad batch must not end the subscription
            logger.exception("KV-event batch %d from %s could not be applied", seq, self.endpoint)

    def _fill_gap(self, first: int, next_seq: int) -> None:
        """Batches `first` .. `next_seq - 1` from the replay socket, or `on_gap` without one."""
        if self.replay_endpoint is not None and self._replay(first, next_seq):
            return
        logger.warning("KV events %d..%d from %s were lost", first, next_seq - 1, self.endpoint)
        if self._on_gap is not None:
            self._on_gap()

    def _replay(self, first: int, next_seq: int) -> bool:
        assert self.replay_endpoint is not None
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self.replay_endpoint)
            socket.send_multipart((b"", seq_bytes(first)))
            while socket.poll(_REPLAY_TIMEOUT_MS):
                _, seq_frame, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_frame, "big", signed=True)
                if seq == END_OF_REPLAY:
                    return self.last_seq >= next_seq - 1
                if seq == self.last_seq + 1 and seq < next_seq:
                    self._deliver(seq, payload)
            return False
        finally:
            socket.close()
