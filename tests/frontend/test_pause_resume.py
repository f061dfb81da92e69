"""pause_generation / resume_generation and sleep / wake_up on a running `AsyncLLM`: each pause
mode does what it says to requests in the middle of their generation, requests that arrive
while paused or asleep wait, and `weight_versions` shows a version advanced during a pause.

The engine core runs in its own process and schedules one step ahead (async scheduling), so a
step is always in flight when a pause arrives: it must land first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs
from shoal.frontend.async_llm import AsyncLLM
from shoal.outputs import RequestOutput, WeightVersionSpan

# Long enough that a pause always finds them running, even on a loaded machine: the three finish
# 96 tokens in about 0.2 s here, and a test pauses after the first three.
NUM_TOKENS = 224
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], [250, 251, 7, 8], list(range(30, 52))]
ENGINE_ARGS = dict(max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="module")
def llama(tiny_checkpoints: dict) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def expected(llama: str) -> list[list[int]]:
    with LLM(llama, multiprocess=False, **ENGINE_ARGS) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as loop_runner:
        yield loop_runner


@pytest.fixture(scope="module")
def engine(llama: str) -> Iterator[AsyncLLM]:
    async_llm = AsyncLLM(EngineArgs(model=llama, async_scheduling=True, **ENGINE_ARGS))  # type: ignore[arg-type]
    yield async_llm
    async_llm.shutdown()


class Stream:
    """One request's DELTA outputs, collected by a task as they come."""

    def __init__(self, engine: AsyncLLM, prompt: list[int], request_id: str) -> None:
        self.outputs: list[RequestOutput] = []
        self.task = asyncio.create_task(self._collect(engine, prompt, request_id))

    async def _collect(self, engine: AsyncLLM, prompt: list[int], request_id: str) -> None:
        async for output in engine.generate({"prompt_token_ids": prompt}, GREEDY, request_id):
            self.outputs.append(output)

    @property
    def tokens(self) -> list[int]:
        return [t for out in self.outputs for t in out.outputs[0].token_ids]

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].outputs[0].finish_reason if self.outputs else None


def start(engine: AsyncLLM, name: str, prompts: list[list[int]] = PROMPTS) -> list[Stream]:
    return [Stream(engine, prompt, f"{name}-{i}") for i, prompt in enumerate(prompts)]


async def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def finish(streams: list[Stream], timeout_s: float = 60.0) -> None:
    await asyncio.wait_for(asyncio.gather(*(s.task for s in streams)), timeout_s)


async def assert_no_progress(streams: list[Stream], seconds: float = 0.5) -> None:
    before = [len(s.tokens) for s in streams]
    await asyncio.sleep(seconds)
    assert [len(s.tokens) for s in streams] == before
    assert not any(s.task.done() for s in streams)


def test_abort_ends_requests_with_their_partial_output_and_later_ones_wait(
    engine: AsyncLLM, expected: list, runner: asyncio.Runner
) -> None:
    async def main() -> None:
        streams = start(engine, "abort")
        await until(lambda: all(len(s.tokens) >= 3 for s in streams))
        await engine.pause_generation(mode="abort")
        assert await engine.is_paused()
        await finish(streams)
        for stream, want in zip(streams, expected):
            assert stream.finish_reason == "abort"
            assert 3 <= len(stream.tokens) < NUM_TOKENS and stream.tokens == want[: len(stream.tokens)]
        assert (await engine.get_stats())["num_used_blocks"] == 0
        late = start(engine, "abort-late", PROMPTS[:1])
        await assert_no_progress(late)
        await engine.resume_generation()
        await finish(late)
        assert late[0].tokens == expected[0] and late[0].finish_reason == "length"

    runner.run(main())


def test_wait_returns_once_running_requests_finished_and_admits_no_new_one(
    engine: AsyncLLM, expected: list, runner: asyncio.Runner
) -> None:
    async def main() -> None:
        streams = start(engine, "wait", PROMPTS[:2])
        await until(lambda: all(len(s.tokens) >= 2 for s in streams))
        pause = asyncio.create_task(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0)  # the pause call is sent: the next request arrives after it
        late = start(engine, "wait-late", PROMPTS[2:])
        await asyncio.wait_for(pause, 60)
        stats = await engine.get_stats()
        assert (stats["num_running_reqs"], stats["num_waiting_reqs"]) == (0, 1)
        await finish(streams, timeout_s=5)  # their last outputs were sent before the reply
        assert [s.tokens for s in streams] == expected[:2]
        assert [s.finish_reason for s in streams] == ["length", "length"]
        await assert_no_progress(late)
        assert late[0].tokens == []
        await engine.resume_generation()
        await finish(late)
        assert late[0].tokens == expected[2]

    runner.run(main())


@pytest.mark.parametrize("clear_cache", [False, True])
def test_keep_freezes_running_requests_and_continues_them_after_resume(
    engine: AsyncLLM, expected: list, runner: asyncio.Runner, clear_cache: bool
) -> None:
    async def main() -> None:
        streams = start(engine, f"keep-{clear_cache}")
        await until(lambda: all(len(s.tokens) >= 3 for s in streams))
        await engine.pause_generation(mode="keep", clear_cache=clear_cache)
        await asyncio.sleep(0.1)  # the outputs of the steps that landed reach the streams
        await assert_no_progress(streams)
        stats = await engine.get_stats()
        assert stats["num_running_reqs"] == (0 if clear_cache else 3)
        # Without clear_cache the frozen requests keep their KV cache; with it they give it up.
        assert (stats["num_used_blocks"] > 0) == (not clear_cache)
        await engine.resume_generation()
        await finish(streams)
        assert [s.tokens for s in streams] == expected
        assert all(s.finish_reason == "length" for s in streams)

    runner.run(main())


def test_sleep_holds_running_and_new_requests_until_wake_up(
    engine: AsyncLLM, expected: list, runner: asyncio.Runner
) -> None:
    async def main() -> None:
        streams = start(engine, "sleep", PROMPTS[:2])
        await until(lambda: all(len(s.tokens) >= 3 for s in streams))
        await engine.sleep(level=1)
        assert await engine.is_sleeping()
        late = start(engine, "sleep-late", PROMPTS[2:])
        await asyncio.sleep(0.1)
        await assert_no_progress(streams + late)
        assert (await engine.get_stats())["num_used_blocks"] == 0  # the KV cache is gone
        await engine.wake_up(tags=["weights"])
        await assert_no_progress(streams + late, seconds=0.2)
        await engine.wake_up(tags=["kv_cache"])
        assert not await engine.is_sleeping()
        await finish(streams + late)
        assert [s.tokens for s in streams + late] == expected  # recomputed where they stopped

    runner.run(main())


def test_bad_pause_mode_is_a_value_error(engine: AsyncLLM, runner: asyncio.Runner) -> None:
    with pytest.raises(ValueError, match="pause mode"):
        runner.run(engine.pause_generation(mode="retract"))
    assert not runner.run(engine.is_paused())


def test_weight_versions_span_a_version_advanced_while_paused_in_keep_mode(llama: str, expected: list) -> None:
    """In-process, so that the test can advance the version as a weight update does."""
    engine = AsyncLLM(EngineArgs(model=llama, **ENGINE_ARGS), multiprocess=False)  # type: ignore[arg-type]
    scheduler = engine.engine_core.core.scheduler

    async def main() -> tuple[list[Stream], list[int]]:
        streams = start(engine, "versions", PROMPTS[:2])
        await until(lambda: all(len(s.tokens) >= 3 for s in streams))
        await engine.pause_generation(mode="keep", clear_cache=False)
        num_before = [scheduler.requests[f"versions-{i}"].num_output_tokens for i in range(2)]
        scheduler.advance_weight_version("v1")
        await engine.resume_generation()
        await finish(streams)
        return streams, num_before

    try:
        streams, num_before = asyncio.run(main())
    finally:
        engine.shutdown()
    for stream, k, want in zip(streams, num_before, expected):
        assert stream.tokens == want
        assert 3 <= k < NUM_TOKENS
        # Each delta's spans cover its own tokens; laid end to end they give the completion's.
        spans: list[WeightVersionSpan] = []
        offset = 0
        for out in stream.outputs:
            completion = out.outputs[0]
            assert sum(s.end - s.start for s in completion.weight_versions) == len(completion.token_ids)
            for span in completion.weight_versions:
                if spans and spans[-1].version == span.version and spans[-1].end == offset + span.start:
                    spans[-1] = spans[-1]._replace(end=offset + span.end)
                else:
                    spans.append(WeightVersionSpan(span.version, offset + span.start, offset + span.end))
            offset += len(completion.token_ids)
        assert spans == [WeightVersionSpan("0", 0, k), WeightVersionSpan("v1", k, NUM_TOKENS)]


def test_final_outputs_carry_the_spans_of_the_whole_completion(llama: str) -> None:
    engine = LLM(llama, multiprocess=False, **ENGINE_ARGS)
    try:
        engine.engine_core.core.scheduler.advance_weight_version("step-3")
        (output,) = engine.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=5, n=2), use_tqdm=False)
    finally:
        engine.shutdown()
    for completion in output.outputs:
        assert completion.weight_versions == (WeightVersionSpan("step-3", 0, len(completion.token_ids)),)


def test_steps_in_flight_land_before_a_pause_takes_effect(llama: str, expected: list) -> None:
    """The engine core itself, with async scheduling: a step is in flight when the pause comes;
    it lands (its tokens become outputs for the frontend) and nothing is in flight after."""
    from shoal.protocol import EngineCoreRequest

    with LLM(llama, multiprocess=False, async_scheduling=True, **ENGINE_ARGS) as llm:
        core = llm.engine_core.core
        core.add_request(EngineCoreRequest("r", PROMPTS[0], GREEDY, None, 0.0, NUM_TOKENS))
        tokens: list[int] = []
        for _ in range(4):
            tokens += [t for o in core.step().outputs for t in o.new_token_ids]
        assert core.batch_queue and tokens  # a step in flight, some tokens out
        core.pause_generation("keep", clear_cache=False)
        assert not core.batch_queue and core.scheduler.requests["r"].num_steps_in_flight == 0
        landed = [t for outputs in core.side_outputs for o in outputs.outputs for t in o.new_token_ids]
        assert landed and core.settle_pause()
        assert core.step().outputs == []  # paused: nothing runs
        core.resume_generation()
        tokens += landed
        while core.has_work():
            tokens += [t for o in core.step().outputs for t in o.new_token_ids]
        assert tokens == expected[0]


def test_weight_version_spans_of_any_stretch_of_a_completion() -> None:
    from shoal.frontend.output_processor import WeightVersions

    versions = WeightVersions()
    versions.start("0", 0)
    assert versions.spans(0, 4) == (WeightVersionSpan("0", 0, 4),)
    assert versions.spans(3, 4) == (WeightVersionSpan("0", 0, 1),) and versions.spans(4, 4) == ()
    versions.start("a", 4)
    versions.start("b", 6)
    assert versions.spans(0, 9) == (
        WeightVersionSpan("0", 0, 4),
        WeightVersionSpan("a", 4, 6),
        WeightVersionSpan("b", 6, 9),
    )
    assert versions.spans(3, 7) == (
        WeightVersionSpan("0", 0, 1),
        WeightVersionSpan("a", 1, 3),
        WeightVersionSpan("b", 3, 4),
    )
    assert versions.spans(8, 9) == (WeightVersionSpan("b", 0, 1),)  # no stale single-version cache
