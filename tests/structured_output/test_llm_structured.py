"""Structured output through `LLM.generate` on a tiny random checkpoint: whatever a random model
samples, the grammar keeps it valid. 50 random JSON schemas batched with free requests (whose
greedy outputs do not change), choice, regex and grammar with n > 1, async
scheduling giving the synchronous tokens, preemption, and bad specs refused."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from shoal import LLM, SamplingParams
from shoal.sampling_params import StructuredOutputsParams
from tests.structured_output.random_schemas import random_schema

MAX_MODEL_LEN = 512
FREE_PROMPTS = ["Hello world!", "The quick brown fox", "one two three"]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoints: dict[str, Path]) -> str:
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[LLM]:
    import torch

    # One thread: a tiny model's matrices are too small to share, and on a loaded CI machine
    # two OpenMP threads waiting on each other cost far more than the arithmetic.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = LLM(model_path, multiprocess=False, max_model_len=MAX_MODEL_LEN, max_num_seqs=64, async_scheduling=False)
    yield engine
    engine.shutdown()
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def ascii_only(llm: LLM) -> dict[int, float]:
    """A logit_bias against the tokens that are not whole ASCII text. A random model strings
    byte tokens into invalid UTF-8, and xgrammar takes some of that (overlong 3-byte forms) for
    characters, which a JSON parser then reads as U+FFFD; trained models do not write such
    bytes (docs/openai-extensions.md, "Limits")."""
    tokenizer = llm.get_tokenizer()
    return {t: -100.0 for t in range(len(tokenizer)) if not tokenizer.decode([t]).isascii()}


def schema_params(seed: int, schema: dict, bias: dict[int, float] | None = None, **extra: object) -> SamplingParams:
    # Sampled at temperature 1 (seeded), so that the random model wanders all over the grammar.
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=300,
        structured_outputs=StructuredOutputsParams(json=schema),
        logit_bias=bias,
        **extra,
    )


def test_fifty_random_schemas_batched_with_free_requests(llm: LLM, ascii_only: dict[int, float]) -> None:
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(50)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [f"Request {i}:" for i in range(50)] + FREE_PROMPTS
    params = [schema_params(i, s, ascii_only) for i, s in enumerate(schemas)] + [greedy] * len(FREE_PROMPTS)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
    free_alone = llm.generate(FREE_PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[50:]] == [o.outputs[0].token_ids for o in free_alone]


def test_choice_regex_and_grammar_with_n(llm: LLM) -> None:
    specs = {
        "choice": StructuredOutputsParams(choice=["red", "green", "blue sky"]),
        "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,6} \d{3}-\d{4}"),
        "grammar": StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
    }
    params = [
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, structured_outputs=s) for s in specs.values()
    ]
    outputs = dict(zip(specs, llm.generate(["Answer:"] * len(specs), params, use_tqdm=False)))
    texts = {kind: [c.text for c in output.outputs] for kind, output in outputs.items()}
    assert all(c.finish_reason == "stop" for output in outputs.values() for c in output.outputs)
    assert all(t in ("red", "green", "blue sky") for t in texts["choice"])
    assert all(re.fullmatch(r"[A-Z][a-z]{2,6} \d{3}-\d{4}", t) for t in texts["regex"])
    assert all(re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t) for t in texts["grammar"])


def test_async_scheduling_gives_the_synchronous_tokens(llm: LLM, model_path: str) -> None:
    """Structured requests run one step ahead under async scheduling (their bitmask follows
    the launch): the same tokens as the synchronous engine, with logprobs and stop strings."""
    rng = random.Random(7)
    schemas = [random_schema(rng) for _ in range(8)]
    params = [schema_params(i, s, logprobs=2 if i % 2 else None) for i, s in enumerate(schemas)]
    params += [
        SamplingParams(temperature=0.0, max_tokens=24, stop=["o"]),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    prompts = [f"Item {i}" for i in range(len(params))]
    expected = llm.generate(prompts, params, use_tqdm=False)
    with LLM(model_path, multiprocess=False, max_model_len=MAX_MODEL_LEN, async_scheduling=True) as async_llm:
        assert async_llm.config.scheduler_config.async_scheduling
        got = async_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    for g, e in zip(got[:8], expected[:8]):
        if e.outputs[0].logprobs is not None:
            assert g.outputs[0].logprobs is not None
            assert [sorted(row) for row in g.outputs[0].logprobs] == [sorted(row) for row in e.outputs[0].logprobs]


def test_a_bitmask_carried_by_the_step_gives_the_synchronous_tokens(
    llm: LLM, model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An executor that takes a step's bitmask only with the step (as over Ray), under async
    scheduling: the scheduler fills it as it builds the step and keeps structured requests from
    running ahead (their grammars must have seen every token), so the tokens are the
    synchronous ones."""
    from shoal.executors.uniproc import UniProcExecutor

    rng = random.Random(11)
    params = [schema_params(i, random_schema(rng)) for i in range(4)]
    params.append(SamplingParams(temperature=0.0, max_tokens=24))
    prompts = [f"Item {i}" for i in range(len(params))]
    expected = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setattr(UniProcExecutor, "samples_later", False)
    with LLM(model_path, multiprocess=False, max_model_len=MAX_MODEL_LEN, async_scheduling=True) as carried:
        got = carried.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_preempted_structured_requests_resume_where_they_were(
    llm: LLM, model_path: str, ascii_only: dict[int, float]
) -> None:
    """Greedy (a seeded request's random stream starts again when it is rebuilt after a
    preemption): the same tokens as without preemption, the matcher carried across it."""
    rng = random.Random(3)
    schemas = [random_schema(rng) for _ in range(6)]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=s), logit_bias=ascii_only
        )
        for s in schemas
    ]
    prompts = [f"Document {i} " * 8 for i in range(len(params))]
    expected = llm.generate(prompts, params, use_tqdm=False)
    # 40 blocks of 4 tokens: the six requests cannot all hold their KV at once.
    with LLM(model_path, multiprocess=False, max_model_len=160, block_size=4, num_gpu_blocks_override=40) as small:
        got = small.generate(prompts, params, use_tqdm=False)
        assert small.get_stats()["num_preemptions"] > 0
        assert small.get_stats()["num_used_blocks"] == 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    for schema, output in zip(schemas, got):
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_bad_specs_are_refused_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValueError, match="invalid JSON schema"):
        llm.generate(
            "x", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "nope"})), use_tqdm=False
        )
    with pytest.raises(ValueError, match="logit_bias token id 9999"):
        llm.generate("x", SamplingParams(logit_bias={9999: 1.0}), use_tqdm=False)
    assert llm.get_stats()["num_running_reqs"] == 0
    [output] = llm.generate("x", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_logit_bias_steers_greedy_decoding(llm: LLM) -> None:
    token = llm.get_tokenizer().encode("fox", add_special_tokens=False)[0]
    [output] = llm.generate(
        "Hello",
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={token: 100.0}),
        use_tqdm=False,
    )
    assert output.outputs[0].token_ids == [token] * 5
