"""Prefill/decode disaggregation through Ray (shoal/entrypoints/disaggregated/): one prefill and
one decode engine actor behind the proxy give a single engine's greedy tokens; a killed decode
or prefill engine ends each affected request with a retry or a 503 within bounds, the proxy
serves on, and no KV block, transfer or process is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shoal import LLM, SamplingParams, envs
from shoal.config import EngineArgs
from shoal.entrypoints.disaggregated.engine_pool import DisaggregationOptions
from shoal.entrypoints.disaggregated.proxy import DisaggregatedLLM
from shoal.errors import RequestUnavailableError
from shoal.sampling_params import StructuredOutputsParams

ENGINE = {"block_size": 4, "max_model_len": 256, "max_num_seqs": 16}
OPTIONS = DisaggregationOptions(
    num_prefill=1, num_decode=1, num_cpus_per_engine=1.0, transfer_timeout_s=3.0, stall_timeout_s=12.0
)
# A request affected by a dead engine ends (retried or 503) within this many seconds.
BOUND_S = OPTIONS.max_attempts * OPTIONS.stall_timeout_s + 10.0
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def model_path(tiny_checkpoints: dict[str, Path]) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def single(model_path: str) -> Iterator[LLM]:
    llm = LLM(model_path, multiprocess=False, **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def proxy(ray_cluster: dict, model_path: str, loop: asyncio.AbstractEventLoop) -> Iterator[DisaggregatedLLM]:
    engine = DisaggregatedLLM(EngineArgs(model=model_path, **ENGINE), OPTIONS)
    pids = set(engine.engine_core.pids)
    yield engine
    pids |= set(_engine_pids(engine).values())
    engine.shutdown()
    if engine._handler is not None:  # the output handler ends with the loop's next turn
        engine._handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(engine._handler)
    _assert_gone(pids)


def _engine_pids(engine: DisaggregatedLLM) -> dict[str, int]:
    """Each role's engine process (waiting for one Ray is restarting)."""
    import ray

    client = engine.engine_core
    pids = {}
    deadline = time.monotonic() + 60
    for role, pool in (("prefill", client.prefill), ("decode", client.decode)):
        while role not in pids:
            try:
                pids[role] = ray.get(pool.actors[0].ready.remote(), timeout=10)["pid"]
            except ray.exceptions.RayError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return pids


def _assert_gone(pids: set[int]) -> None:
    deadline = time.monotonic() + 15
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"engine process {pid} is still running")


def _mixed_requests(tokenizer: Any) -> list[tuple[list[int], SamplingParams]]:
    """32 requests: prompts sharing a long system prefix (prefix hits on both engines), JSON
    schemas, stop strings, logprobs; all greedy."""
    system = tokenizer.encode("You are a helpful assistant who answers in short sentences.")
    requests = []
    for i in range(32):
        prompt = [*system, *tokenizer.encode(f" Question {i}: what is {i} plus {i * 3}?")]
        extra: dict[str, Any] = {}
        if i % 4 == 1:
            extra["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
        elif i % 4 == 2:
            extra["stop"] = ["e", "a "]
        elif i % 4 == 3:
            extra["logprobs"] = 2
        requests.append(
            (prompt if i % 2 else prompt[len(system) // 2 :], SamplingParams(temperature=0.0, max_tokens=10, **extra))
        )
    return requests


async def _run(
    engine: Any, request_id: str, prompt: list[int], params: SamplingParams, streaming: asyncio.Event | None = None
) -> Any:
    """The request's merged output; `streaming` is set at its first tokens."""
    final = None
    async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id):
        final = output if final is None else _merge(final, output)
        if streaming is not None and final.outputs[0].token_ids:
            streaming.set()
    return final


def _merge(final: Any, delta: Any) -> Any:
    completion, new = final.outputs[0], delta.outputs[0]
    completion.token_ids = [*completion.token_ids, *new.token_ids]
    completion.text += new.text
    completion.finish_reason = new.finish_reason
    if new.logprobs:
        completion.logprobs = [*(completion.logprobs or []), *new.logprobs]
    return final


def _leftover_transfers(prefix: str) -> list[Path]:
    return list(Path(envs.SHOAL_KV_TRANSFER_DIR).glob(prefix + "*"))


def _settled_stats(engine: DisaggregatedLLM, loop: asyncio.AbstractEventLoop) -> dict[str, Any]:
    """The engines' summed counters once no block is held (aborts land asynchronously)."""
    deadline = time.monotonic() + 20
    while True:
        stats = loop.run_until_complete(engine.get_stats())
        if stats.get("num_used_blocks", 1) == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def test_prefill_and_decode_engines_give_the_single_engines_tokens(
    proxy: DisaggregatedLLM, single: LLM, loop: asyncio.AbstractEventLoop
) -> None:
    requests = _mixed_requests(single.get_tokenizer())
    expected = single.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)

    async def main() -> list[Any]:
        return await asyncio.gather(*(_run(proxy, f"mixed-{i}", p, s) for i, (p, s) in enumerate(requests)))

    outputs = loop.run_until_complete(asyncio.wait_for(main(), 120))
    for ours, want in zip(outputs, expected, strict=True):
        assert ours.outputs[0].token_ids == want.outputs[0].token_ids
        assert ours.outputs[0].text == want.outputs[0].text
        assert ours.outputs[0].finish_reason == want.outputs[0].finish_reason
        if want.outputs[0].logprobs:
            for a, b in zip(ours.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in b)
    stats = _settled_stats(proxy, loop)
    # Every prompt's KV came over (none recomputed): its tokens but the last, less the decode
    # engine's own prefix hits.
    assert stats["kv_transfer_loaded"] == stats["kv_transfer_saved"] == 32
    assert stats["kv_transfer_tokens_loaded"] + stats["prefix_cache_hits"] >= sum(len(p) - 1 for p, _ in requests)
    assert stats["kv_transfer_failed"] == 0 and stats["num_used_blocks"] == 0
    assert not _leftover_transfers("mixed-")


def test_an_aborted_stream_frees_its_blocks_on_both_engines(
    proxy: DisaggregatedLLM, single: LLM, loop: asyncio.AbstractEventLoop
) -> None:
    prompt = single.get_tokenizer().encode("Abort me after my first token, please, right away.")
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def first_token_then_close() -> None:
        stream = proxy.generate({"prompt_token_ids": prompt}, params, "abort-me")
        async for output in stream:
            if output.outputs[0].token_ids:
                break
        await stream.aclose()  # what a client that disconnects does

    loop.run_until_complete(asyncio.wait_for(first_token_then_close(), 60))
    assert _settled_stats(proxy, loop)["num_used_blocks"] == 0
    assert not _leftover_transfers("abort-me")


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_engine_ends_each_request_with_a_retry_or_a_503_in_time(
    proxy: DisaggregatedLLM, single: LLM, loop: asyncio.AbstractEventLoop, role: str
) -> None:
    """Six requests decode; once tokens flow the engine of `role` is killed, and six more are
    sent at once. Those decoding on a killed decode engine fail with a 503 (tokens were streamed)
    or are retried; those sent to a killed prefill engine are retried once Ray restarted it."""
    tokenizer = single.get_tokenizer()
    prompts = [tokenizer.encode(f"Request {i} of the {role} test: count slowly to a hundred.") for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    pid = _engine_pids(proxy)[role]
    client = proxy.engine_core
    retries_before, failures_before = client.stats["pd_retries"], client.stats["pd_failures"]

    async def one(i: int, streaming: asyncio.Event) -> tuple[Any, float]:
        start = time.monotonic()
        try:
            return await _run(proxy, f"kill-{role}-{i}", prompts[i], params, streaming), time.monotonic() - start
        except RequestUnavailableError as exc:
            return exc, time.monotonic() - start

    async def main() -> list[tuple[Any, float]]:
        streaming = asyncio.Event()
        tasks = [asyncio.ensure_future(one(i, streaming)) for i in range(6)]
        await asyncio.wait_for(streaming.wait(), 30)
        os.kill(pid, signal.SIGKILL)
        tasks += [asyncio.ensure_future(one(i, asyncio.Event())) for i in range(6, 12)]
        return await asyncio.gather(*tasks)

    results = loop.run_until_complete(asyncio.wait_for(main(), BOUND_S + 30))
    for (result, seconds), want in zip(results, expected, strict=True):
        assert seconds < BOUND_S
        if isinstance(result, RequestUnavailableError):
            assert "could not be served" in str(result)
        else:
            assert result.outputs[0].token_ids == want.outputs[0].token_ids
    num_503 = sum(isinstance(r, RequestUnavailableError) for r, _ in results)
    assert client.stats["pd_failures"] - failures_before == num_503
    assert client.stats["pd_retries"] > retries_before  # the requests sent after the kill
    # The proxy serves on (Ray has restarted the engine).
    after = loop.run_until_complete(asyncio.wait_for(_run(proxy, f"after-{role}", prompts[0], params), BOUND_S))
    assert after.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert _engine_pids(proxy)[role] != pid
    stats = _settled_stats(proxy, loop)
    assert stats["num_used_blocks"] == 0
    assert not _leftover_transfers(f"kill-{role}-") and not _leftover_transfers(f"after-{role}")


def test_the_openai_server_on_the_proxy_streams_and_answers_503_when_no_engine_can_serve(
    proxy: DisaggregatedLLM, loop: asyncio.AbstractEventLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    from shoal.entrypoints.openai.api_server import build_app
    from shoal.kv_transfer.params import KVTransferError

    app = build_app(proxy)
    model = proxy.config.model_config.served_model_name
    body = {"model": model, "prompt": "Tell me a story about a ship.", "max_tokens": 5, "temperature": 0}

    async def post(payload: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy", timeout=60) as client:
            return await client.post("/v1/completions", json=payload)

    plain = loop.run_until_complete(post(body))
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 5
    streamed = loop.run_until_complete(post({**body, "stream": True}))
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")

    async def failing_attempt(request: Any, attempt: int) -> Any:
        raise KVTransferError("kv transfer failed: injected")
        yield  # an async generator, as the real one

    monkeypatch.setattr(proxy.engine_core, "_attempt", failing_attempt)
    refused = loop.run_until_complete(post(body))
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "engine_unavailable" and "attempt 3: kv transfer failed: injected" in error["message"]
    monkeypatch.undo()
    assert loop.run_until_complete(post(body)).status_code == 200  # the proxy serves on
