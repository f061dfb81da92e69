"""The engine core's side of structured output, with the real grammar library and a fake model:
grammars compile off the loop without holding anyone up, a failed one finishes its request,
the bitmask covers the structured requests that sample in a step (after their reasoning), and
matchers follow the accepted tokens."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from shoal.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from shoal.engine_core.request import Request
from shoal.engine_core.scheduler import Scheduler
from shoal.sampling_params import SamplingParams
from shoal.structured_output.manager import StructuredOutputManager
from shoal.structured_output.params import StructuredOutputsParams
from tests.engine_core.test_scheduler import assert_all_free, step

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_config(tiny_checkpoints: dict[str, Path]) -> ModelConfig:
    return EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu").create_engine_config().model_config


@pytest.fixture(scope="module")
def tokenizer(model_config: ModelConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_config.tokenizer)


def make_scheduler(
    model_config: ModelConfig,
    max_num_batched_tokens: int = 64,
    async_scheduling: bool = False,
    samples_later: bool = False,
) -> Scheduler:
    manager = StructuredOutputManager(model_config)
    config = SchedulerConfig(16, max_num_batched_tokens, 512, async_scheduling)
    return Scheduler(config, CacheConfig(block_size=4), NUM_BLOCKS, manager, samples_later=samples_later)


def request(request_id: str, structured: StructuredOutputsParams | None, eos: int, prompt_len: int = 5) -> Request:
    params = SamplingParams(max_tokens=20, structured_outputs=structured)
    return Request(request_id, list(range(10, 10 + prompt_len)), params, eos, 20)


def bitmask_rows(scheduler: Scheduler, sched_out) -> tuple[list[str], np.ndarray] | None:
    manager = scheduler.structured_output
    assert manager is not None
    return manager.fill_bitmask(manager.requests_of(sched_out.structured_req_ids))


def allowed(bitmask: np.ndarray, row: int, vocab_size: int) -> set[int]:
    return {t for t in range(vocab_size) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}


def test_a_grammar_being_compiled_holds_up_no_one(model_config: ModelConfig, tokenizer, monkeypatch) -> None:
    scheduler = make_scheduler(model_config)
    manager = scheduler.structured_output
    assert manager is not None
    release = threading.Event()
    compile_grammar = manager._compile

    def slow_compile(params: StructuredOutputsParams):
        release.wait(30)
        return compile_grammar(params)

    monkeypatch.setattr(manager, "_compile", slow_compile)
    scheduler.add_request(request("slow", StructuredOutputsParams(regex="[a-z]+"), tokenizer.eos_token_id))
    scheduler.add_request(request("free", None, tokenizer.eos_token_id))
    for _ in range(3):
        sched_out, _ = step(scheduler)
        assert list(sched_out.num_scheduled_tokens) == ["free"]
    release.set()
    manager.wait_for_any(manager.compiling, 30)
    sched_out, _ = step(scheduler)
    assert "slow" in sched_out.num_scheduled_tokens and sched_out.structured_req_ids == ["slow"]
    manager.shutdown()


def test_a_grammar_that_fails_to_compile_finishes_its_request(model_config: ModelConfig, tokenizer) -> None:
    scheduler = make_scheduler(model_config)
    scheduler.add_request(request("bad", StructuredOutputsParams(regex="(unclosed"), tokenizer.eos_token_id))
    assert scheduler.structured_output is not None
    scheduler.structured_output.wait_for_any(scheduler.structured_output.compiling, 30)
    sched_out = scheduler.schedule()
    assert not sched_out.num_scheduled_tokens
    [output] = scheduler.take_outputs_outside_steps()
    assert output.request_id == "bad" and output.finish_reason == "abort" and "invalid regex" in str(output.stop_reason)
    assert_all_free(scheduler, NUM_BLOCKS)
    assert scheduler.structured_output.requests == {}


def _admit(scheduler: Scheduler) -> None:
    assert scheduler.structured_output is not None
    while scheduler.structured_output.compiling:
        scheduler.structured_output.wait_for_any(scheduler.structured_output.compiling, 30)
        scheduler._admit_compiled()


def test_rows_are_the_structured_requests_that_sample(model_config: ModelConfig, tokenizer) -> None:
    """A chunked prompt samples only at its last chunk; a free request never has a row; the
    row allows what the grammar allows after the accepted tokens."""
    eos = tokenizer.eos_token_id
    scheduler = make_scheduler(model_config, max_num_batched_tokens=8)
    scheduler.add_request(request("choice", StructuredOutputsParams(choice=["one two", "three"]), eos, prompt_len=12))
    scheduler.add_request(request("free", None, eos, prompt_len=3))
    _admit(scheduler)
    first, _ = step(scheduler)  # 8 of choice's 12 prompt tokens
    assert first.structured_req_ids == []
    sched_out = scheduler.schedule()  # the rest of the prompt (and the free one's)
    assert sched_out.structured_req_ids == ["choice"]
    req_ids, bitmask = bitmask_rows(scheduler, sched_out) or ([], None)
    assert req_ids == ["choice"] and bitmask is not None
    first_tokens = allowed(bitmask, 0, len(tokenizer))
    assert all(
        "one two".startswith(tokenizer.decode([t])) or "three".startswith(tokenizer.decode([t])) for t in first_tokens
    )
    three = tokenizer.encode("three", add_special_tokens=False)
    from tests.engine_core.test_scheduler import fake_model_output

    scheduler.update_from_output(sched_out, fake_model_output(scheduler, sched_out, lambda r: three[0]))
    sched_out = scheduler.schedule()
    _, bitmask = bitmask_rows(scheduler, sched_out) or ([], None)
    expected_next = three[1] if len(three) > 1 else eos
    assert bitmask is not None and allowed(bitmask, 0, len(tokenizer)) == {expected_next}


def test_the_grammar_starts_after_the_reasoning(model_config: ModelConfig, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    end = tokenizer.encode("</x>", add_special_tokens=False)
    scheduler = make_scheduler(model_config)
    params = StructuredOutputsParams(regex="yes|no", reasoning_end_token_ids=end)
    scheduler.add_request(request("r", params, eos))
    _admit(scheduler)
    from tests.engine_core.test_scheduler import fake_model_output

    tokens = [*tokenizer.encode("hmm ", add_special_tokens=False), *end]
    for token in tokens:
        sched_out = scheduler.schedule()
        assert sched_out.structured_req_ids == ["r"]
        assert bitmask_rows(scheduler, sched_out) is None  # still thinking: free
        scheduler.update_from_output(sched_out, fake_model_output(scheduler, sched_out, lambda r, t=token: t))
    sched_out = scheduler.schedule()
    filled = bitmask_rows(scheduler, sched_out)
    assert filled is not None
    decoded = {tokenizer.decode([t]) for t in allowed(filled[1], 0, len(tokenizer))}
    assert decoded and all("yes".startswith(d) or "no".startswith(d) for d in decoded)
    scheduler.abort_requests(["r"])
    assert scheduler.requests == {} and scheduler.structured_output.requests == {}


@pytest.mark.parametrize("samples_later", [False, True])
def test_the_scheduler_decides_whether_the_bitmask_travels_with_the_step(
    model_config: ModelConfig, tokenizer, samples_later: bool
) -> None:
    """An executor that cannot take the bitmask after the launch gets it in the step, filled as
    the step is built; one that can gets a step that says it follows, and the manager fills it
    when asked (the same rows)."""
    scheduler = make_scheduler(model_config, samples_later=samples_later)
    scheduler.add_request(request("choice", StructuredOutputsParams(choice=["yes", "no"]), tokenizer.eos_token_id))
    scheduler.add_request(request("free", None, tokenizer.eos_token_id))
    _admit(scheduler)
    sched_out = scheduler.schedule()
    assert sched_out.structured_req_ids == ["choice"] and sched_out.grammar_follows == samples_later
    manager = scheduler.structured_output
    assert manager is not None
    filled = manager.grammar_bitmask(sched_out.structured_req_ids)
    assert filled is not None and filled.req_ids == ["choice"]
    assert sched_out.grammar == (None if samples_later else filled)


@pytest.mark.parametrize("samples_later", [False, True])
def test_a_request_whose_bitmask_travels_with_the_step_never_runs_ahead(
    model_config: ModelConfig, tokenizer, samples_later: bool
) -> None:
    """Async scheduling: a step that carries its bitmask is filled as it is built, so its
    structured requests must not be scheduled again before their last token is known; where
    the bitmask follows, they run ahead like the others."""
    eos = tokenizer.eos_token_id
    scheduler = make_scheduler(model_config, async_scheduling=True, samples_later=samples_later)
    scheduler.add_request(request("regex", StructuredOutputsParams(regex="[a-z]+"), eos))
    scheduler.add_request(request("free", None, eos))
    _admit(scheduler)
    first = scheduler.schedule()  # the prompts
    assert set(first.num_scheduled_tokens) == {"regex", "free"}
    ahead = scheduler.schedule()  # the first step still runs
    expected = {"regex", "free"} if samples_later else {"free"}
    assert set(ahead.num_scheduled_tokens) == expected
