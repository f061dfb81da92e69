"""KV-cache events: published over ZeroMQ by a real engine and read back by a subscriber, they
carry exactly the block hashes the KV manager computed, in order, a `BlockRemoved` for each
eviction (the subscriber's view equals the engine's prefix cache), and `AllBlocksCleared` on
a reset; the replay socket fills a gap."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from shoal import LLM, SamplingParams
from shoal.engine_core.kv_cache_manager import hash_block_tokens
from shoal.kv_events.config import KVEventsConfig
from shoal.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, stored_events
from shoal.kv_events.publisher import ZmqEventPublisher
from shoal.kv_events.subscriber import EventSubscriber

BLOCK_SIZE = 4
NUM_BLOCKS = 16  # 64 tokens: a few prompts evict each other
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


class Collector:
    def __init__(self) -> None:
        self.events: list = []
        self.batches: list[tuple[int, KVEventBatch]] = []
        self.lock = threading.Lock()

    def __call__(self, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            self.batches.append((seq, batch))
            self.events += batch.events

    def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.events):
            assert time.monotonic() < deadline, f"events so far: {self.events}"
            time.sleep(0.01)

    def cached_hashes(self) -> set[bytes]:
        """The prefix cache as the events describe it."""
        cached: set[bytes] = set()
        for event in self.events:
            if isinstance(event, BlockStored):
                cached |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached -= set(event.block_hashes)
            else:
                cached.clear()
        return cached


def chain_hashes(token_ids: list[int]) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // BLOCK_SIZE):
        hashes.append(
            hash_block_tokens(hashes[-1] if hashes else None, token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
        )
    return hashes


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict, tmp_path_factory: pytest.TempPathFactory):
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv_events')}/events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    llm = LLM(
        str(tiny_checkpoints["llama"]),
        multiprocess=False,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        max_model_len=NUM_BLOCKS * BLOCK_SIZE,
        kv_events_config=config,
    )
    collector = Collector()
    subscriber = EventSubscriber(endpoint, collector, topic="kv")
    time.sleep(0.3)  # ZeroMQ's slow joiner: the subscription reaches the publisher
    yield llm, collector
    subscriber.close()
    llm.shutdown()


def _pool(llm: LLM):
    return llm.engine_core.core.scheduler.kv_cache_manager.block_pool


def test_stored_blocks_carry_the_managers_hashes_in_order(engine) -> None:
    llm, collector = engine
    prompt = list(range(10, 10 + 5 * BLOCK_SIZE + 2))  # five full blocks and two tokens
    before = len(collector.events)
    llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    collector.wait_for(lambda events: len(events) > before)
    stored = [e for e in collector.events[before:] if isinstance(e, BlockStored)]
    expected = chain_hashes(prompt)
    assert [h for e in stored for h in e.block_hashes] == expected
    assert stored[0].parent_block_hash is None and stored[0].block_size == BLOCK_SIZE
    assert stored[0].token_ids == prompt[: len(stored[0].block_hashes) * BLOCK_SIZE]
    assert stored[0].medium == "GPU" and stored[0].lora_id is None
    assert set(expected) <= set(_pool(llm)._cached)


def test_evictions_are_removed_and_the_view_equals_the_cache(engine) -> None:
    llm, collector = engine
    prompts = [[100 + 7 * p + i for i in range(6 * BLOCK_SIZE + 1)] for p in range(6)]  # 6 blocks each
    for prompt in prompts:  # one at a time: each evicts the blocks of those before it
        llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    engine_cache = set(_pool(llm)._cached)
    collector.wait_for(lambda events: collector.cached_hashes() == engine_cache)
    removed = [h for e in collector.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    stored = [h for e in collector.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(removed) == len(set(removed)) and set(removed) <= set(stored)
    assert set(chain_hashes(prompts[0])) <= set(removed)  # the first prompt's blocks were reused
    assert len(stored) - len(removed) == len(engine_cache) <= NUM_BLOCKS


def test_reset_prefix_cache_clears_all(engine) -> None:
    llm, collector = engine
    llm.generate([{"prompt_token_ids": list(range(300, 300 + 3 * BLOCK_SIZE))}], ONE_TOKEN, use_tqdm=False)
    assert llm.reset_prefix_cache()
    collector.wait_for(lambda events: isinstance(events[-1], AllBlocksCleared))
    assert collector.cached_hashes() == set() == set(_pool(llm)._cached)
    seqs = [seq for seq, _ in collector.batches]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_events_stay_off_unless_enabled(tiny_checkpoints: dict) -> None:
    llm = LLM(str(tiny_checkpoints["llama"]), multiprocess=False, max_model_len=64)
    assert llm.engine_core.core.kv_events is None and _pool(llm).kv_events is None
    llm.shutdown()


def test_wire_format_and_replay(tmp_path) -> None:
    """Frames [topic, seq, msgpack array batch] as vLLM's; a late subscriber gets what it
    missed from the replay socket."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        topic="t",
    )
    publisher = ZmqEventPublisher(config)
    hashes = [b"a" * 16, b"b" * 16]
    publisher.publish(stored_events(hashes, list(range(8)), 4, [0, 1]))
    publisher.publish([])  # no events: no message
    publisher.publish([BlockRemoved(block_hashes=[hashes[1]])])
    time.sleep(0.2)
    context = zmq.Context.instance()
    raw = context.socket(zmq.SUB)
    raw.setsockopt(zmq.SUBSCRIBE, b"t")
    raw.connect(config.endpoint)
    collector = Collector()
    late = EventSubscriber(config.endpoint, collector, topic="t", replay_endpoint=config.replay_endpoint)
    time.sleep(0.3)
    publisher.publish([AllBlocksCleared()])
    topic, seq, payload = raw.recv_multipart()
    assert (topic, int.from_bytes(seq, "big", signed=True)) == (b"t", 2)
    ts, events = msgspec.msgpack.decode(payload)[:2]  # an array: ts, events (tagged arrays)
    assert events == [["AllBlocksCleared"]] and ts > 0
    collector.wait_for(lambda events: len(events) == 3)
    assert [seq for seq, _ in collector.batches] == [0, 1, 2]  # 0 and 1 replayed
    first = collector.events[0]
    assert first.block_hashes == hashes and first.parent_block_hash is None and first.token_ids == list(range(8))
    late.close()
    raw.close()
    publisher.shutdown()


def test_bad_configs_are_value_errors() -> None:
    for bad in ("{", '{"publisher": "kafka"}', '{"enpoint": "x"}', '{"buffer_steps": 0}', "[1]"):
        with pytest.raises(ValueError):
            KVEventsConfig.parse(bad)
    parsed = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert parsed is not None and not parsed.enabled
    with pytest.raises(ValueError, match="cannot bind"):
        ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://no-such-host.invalid:1"))
