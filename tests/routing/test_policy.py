"""The router's pieces without engines: the prefix index kept from events, the prompt hashed
as the KV manager hashes it, and each policy's choice (cache, load, sessions, dead replicas)."""

from __future__ import annotations

import pytest

from shoal.engine_core.kv_cache_manager import KVCacheManager
from shoal.engine_core.request import Request
from shoal.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from shoal.routing.policy import ReplicaState, RoutingPolicy, RoutingRequest
from shoal.routing.prefix_index import PrefixIndex, prompt_block_hashes
from shoal.routing.replicas import replica_argv
from shoal.sampling_params import SamplingParams

BLOCK = 4


def stored(hashes: list[bytes]) -> KVEventBatch:
    return KVEventBatch(
        ts=0.0, events=[BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=BLOCK)]
    )


def replicas(*loads: int) -> list[ReplicaState]:
    return [ReplicaState(name=f"r{i}", url=f"http://r{i}", num_requests=n) for i, n in enumerate(loads)]


def test_prompt_hashes_equal_the_kv_managers() -> None:
    prompt = list(range(3, 3 + 5 * BLOCK + 3))
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    request = Request("r", prompt, SamplingParams(max_tokens=1), eos_token_id=None, max_tokens=1)
    manager.get_computed_blocks(request)  # hashes the request's full blocks
    assert prompt_block_hashes(prompt, BLOCK) == request.block_hashes and len(request.block_hashes) == 5


def test_index_follows_events_and_matches_from_the_start() -> None:
    index = PrefixIndex()
    hashes = prompt_block_hashes(list(range(6 * BLOCK)), BLOCK)
    index.apply("a", stored(hashes[:4]))
    assert index.matched_blocks("a", hashes) == 4 and index.matched_blocks("b", hashes) == 0
    index.apply("a", KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[hashes[1]])]))
    assert index.matched_blocks("a", hashes) == 1  # a hole ends the match, as in the engine
    index.apply("a", KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert index.matched_blocks("a", hashes) == 0 and index.num_blocks("a") == 0


def test_cache_aware_takes_the_longest_prefix() -> None:
    policy = RoutingPolicy("cache_aware")
    conversation = prompt_block_hashes(list(range(8 * BLOCK)), BLOCK)
    policy.index.apply("r0", stored(conversation[:2]))  # the shared system prompt
    policy.index.apply("r1", stored(conversation[:2]))
    policy.index.apply("r2", stored(conversation[:6]))  # this conversation's earlier turns
    pool = replicas(1, 0, 2)
    assert policy.choose(pool, RoutingRequest(conversation)).name == "r2"
    other = prompt_block_hashes(list(range(1000, 1000 + 4 * BLOCK)), BLOCK)
    assert policy.choose(pool, RoutingRequest(other)).name == "r1"  # no match anywhere: least loaded


def test_cache_aware_yields_to_load_imbalance() -> None:
    policy = RoutingPolicy("cache_aware")
    hashes = prompt_block_hashes(list(range(4 * BLOCK)), BLOCK)
    policy.index.apply("r0", stored(hashes))
    assert policy.choose(replicas(4, 0), RoutingRequest(hashes)).name == "r0"  # within the thresholds
    assert policy.choose(replicas(9, 2), RoutingRequest(hashes)).name == "r1"  # 7 more, and over 1.5x


def test_misses_at_equal_load_spread_in_turn() -> None:
    policy = RoutingPolicy("cache_aware")
    chosen = [policy.choose(replicas(0, 0, 0), RoutingRequest(())).name for _ in range(6)]
    assert sorted(chosen) == ["r0", "r0", "r1", "r1", "r2", "r2"]


def test_round_robin_ignores_cache_and_sessions() -> None:
    policy = RoutingPolicy("round_robin")
    hashes = prompt_block_hashes(list(range(4 * BLOCK)), BLOCK)
    policy.index.apply("r1", stored(hashes))
    pool = replicas(0, 0, 0)
    chosen = [policy.choose(pool, RoutingRequest(hashes, session_id="s")).name for _ in range(3)]
    assert sorted(chosen) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("name", ["session", "cache_aware"])
def test_sessions_stay_pinned_until_their_replica_dies(name: str) -> None:
    policy = RoutingPolicy(name)
    pool = replicas(0, 0, 0)
    first = {s: policy.choose(pool, RoutingRequest(session_id=s)).name for s in ("a", "b", "c")}
    assert len(set(first.values())) == 3  # new sessions spread
    hashes = prompt_block_hashes(list(range(4 * BLOCK)), BLOCK)
    for replica in pool:  # the cache elsewhere does not move a pinned session
        policy.index.apply(replica.name, stored(hashes) if replica.name != first["a"] else stored([]))
    assert all(policy.choose(pool, RoutingRequest(hashes, session_id="a")).name == first["a"] for _ in range(4))
    dead = next(r for r in pool if r.name == first["a"])
    dead.alive = False
    moved = policy.choose(pool, RoutingRequest(session_id="a")).name
    assert moved != first["a"]
    dead.alive = True
    assert policy.choose(pool, RoutingRequest(session_id="a")).name == moved  # stays where it moved


def test_dead_replicas_are_skipped_and_none_alive_is_an_error() -> None:
    for name in ("cache_aware", "round_robin", "session"):
        policy = RoutingPolicy(name)
        pool = replicas(0, 0)
        pool[0].alive = False
        assert {policy.choose(pool, RoutingRequest()).name for _ in range(4)} == {"r1"}
        pool[1].alive = False
        with pytest.raises(ValueError, match="no replica"):
            policy.choose(pool, RoutingRequest())
    with pytest.raises(ValueError, match="routing policy"):
        RoutingPolicy("random")


def test_replica_argv_drops_the_routers_flags() -> None:
    argv = ["m", "--num-replicas", "4", "--routing-policy=session", "--port", "8000", "--host", "0.0.0.0"]
    argv += ["--block-size", "8", "--session-header", "X-Conv", "--kv-events-config", "{}"]
    assert replica_argv(argv) == ["m", "--block-size", "8"]


def test_an_adapters_prompt_is_hashed_under_the_adapter() -> None:
    """A request naming a LoRA adapter hashes as the replicas' KV managers hash the adapter's
    blocks; the base model's names (and no `model`) hash as the base."""
    import asyncio
    import json

    from shoal.routing.router import ReplicaEndpoint, Router

    prompt = list(range(3, 3 + 3 * BLOCK))
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    adapter = Request("a", prompt, SamplingParams(max_tokens=1), eos_token_id=None, max_tokens=1, lora_name="sql")
    manager.get_computed_blocks(adapter)
    router = Router([ReplicaEndpoint(url="http://r0")], RoutingPolicy("cache_aware"), BLOCK, base_model_names=["base"])

    def hashes(**body: object) -> list[bytes]:
        routed = asyncio.run(router.routing_request("/v1/completions", json.dumps(body).encode(), {}))
        return routed.block_hashes

    assert hashes(model="sql", prompt=prompt) == adapter.block_hashes
    assert hashes(model="base", prompt=prompt) == hashes(prompt=prompt) == prompt_block_hashes(prompt, BLOCK)
    assert prompt_block_hashes(prompt, BLOCK) != adapter.block_hashes
    assert hashes(model="sql", prompt="no tokenizer") == []
