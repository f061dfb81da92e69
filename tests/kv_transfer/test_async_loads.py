"""A decode engine never stalls on a KV transfer (shoal/engine_core/remote_kv.py,
kv_transfer/pd_connector.py, kv_transfer/background_loads.py): while one request's transfer
never arrives, the other requests keep decoding, then that request ends with the
`kv transfer failed` abort within its timeout; a request aborted while its load is in flight
cancels it; no KV block is left behind either way."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from shoal.config import EngineArgs
from shoal.engine_core.engine_core import EngineCore
from shoal.kv_transfer.params import KV_TRANSFER_FAILED, KVTransferParams
from shoal.protocol import EngineCoreOutput, EngineCoreRequest
from shoal.sampling_params import SamplingParams

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def engine(tiny_checkpoints: dict) -> Iterator[EngineCore]:
    args = EngineArgs(
        model=str(tiny_checkpoints["llama"]), device="cpu", kv_transfer_role="decode", block_size=4, max_model_len=512
    )
    core = EngineCore(args.create_engine_config())
    yield core
    core.shutdown()


def _add(engine: EngineCore, request_id: str, timeout_s: float | None = None) -> None:
    """A request of 10 prompt tokens; with `timeout_s`, one whose KV comes from a transfer that
    no prefill engine ever saves."""
    extra_args = None
    if timeout_s is not None:
        transfer_id = f"missing-{uuid.uuid4().hex}"
        extra_args = KVTransferParams(
            transfer_id=transfer_id, role="load", num_tokens=9, timeout_s=timeout_s
        ).as_extra_args()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, extra_args=extra_args)
    prompt = [(hash(request_id) + 7 * j) % 150 + 3 for j in range(10)]
    engine.add_request(EngineCoreRequest(request_id, prompt, params, None, time.time(), MAX_TOKENS))


def _step(engine: EngineCore) -> list[EngineCoreOutput]:
    return engine.step().outputs


def _finish(engine: EngineCore, request_ids: list[str]) -> None:
    engine.abort_requests(request_ids)
    while engine.has_unfinished_requests():
        _step(engine)


def test_other_requests_decode_while_a_transfer_never_comes_then_it_fails_in_time(engine: EngineCore) -> None:
    num_free_at_start = engine.scheduler.kv_cache_manager.num_free_blocks
    timeout_s = 1.5
    _add(engine, "a")
    _add(engine, "b")
    _step(engine)
    start = time.monotonic()
    _add(engine, "stuck", timeout_s=timeout_s)
    tokens = {"a": 0, "b": 0}
    ended: EngineCoreOutput | None = None
    while ended is None and time.monotonic() - start < timeout_s + 5:
        for output in _step(engine):
            if output.request_id == "stuck":
                ended = output
            else:
                tokens[output.request_id] += len(output.new_token_ids)
        if ended is None:
            assert engine.get_stats()["kv_transfer_loading"] == 1
    elapsed = time.monotonic() - start
    assert ended is not None and ended.finish_reason == "abort"
    assert str(ended.stop_reason).startswith(f"{KV_TRANSFER_FAILED}: KVTransferTimeout")
    assert timeout_s <= elapsed < timeout_s + 1.0
    # Both went on decoding all along (before this change: not one token until the timeout).
    assert min(tokens.values()) >= 20
    stats = engine.get_stats()
    assert stats["kv_transfer_loading"] == 0 and stats["kv_transfer_failed"] == 1 and stats["num_deferred_reqs"] == 0
    _finish(engine, ["a", "b"])
    assert engine.scheduler.kv_cache_manager.num_free_blocks == num_free_at_start
    assert engine.get_stats()["num_used_blocks"] == 0


def test_abort_while_the_load_is_in_flight_cancels_it_and_frees_its_blocks(engine: EngineCore) -> None:
    num_free_at_start = engine.scheduler.kv_cache_manager.num_free_blocks
    _add(engine, "a")
    _step(engine)
    _add(engine, "gone", timeout_s=10.0)
    for _ in range(3):
        _step(engine)
    stats = engine.get_stats()
    assert stats["kv_transfer_loading"] == 1 and stats["num_deferred_reqs"] == 1
    manager = engine.scheduler.kv_cache_manager
    assert len(manager.get_block_ids("gone")) == 3  # its blocks are allocated while it waits
    loads = engine.executor.worker.kv_transfer.loads  # type: ignore[attr-defined]
    assert loads.num_in_flight == 1

    engine.abort_requests(["gone"])
    stats = engine.get_stats()
    assert stats["kv_transfer_loading"] == 0 and stats["num_deferred_reqs"] == 0
    assert stats["num_used_blocks"] == len(manager.get_block_ids("a")) and loads.num_in_flight == 0
    # The engine serves on: "a" keeps decoding, a new request runs to its end.
    assert any(o.request_id == "a" and o.new_token_ids for o in _step(engine))
    _add(engine, "next")
    assert any(o.request_id == "next" and o.new_token_ids for o in _step(engine))
    _finish(engine, ["a", "next"])
    assert manager.num_free_blocks == num_free_at_start
