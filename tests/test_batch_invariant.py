"""`batch_invariant=True` end to end: a request's tokens and logprobs are the same bits alone
and inside random batches of up to 64 requests, with chunked prefill (a small token budget
splits the prompts) and prefix-cache hits (prompts share prefixes, and the cache stays warm
from run to run); and the default mode is not, on this machine (docs/batch_invariance.md)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs

NUM_MIXES = 16
MAX_BATCH = 64
SHARED_PREFIX_TOKENS = 14  # more than three 4-token blocks: cache hits of whole blocks


def _engine(path: Path, batch_invariant: bool, **kwargs: object) -> LLM:
    # 40 tokens a step: the 64-request mixes' prompts run in chunks beside decodes.
    return LLM(
        str(path), multiprocess=False, batch_invariant=batch_invariant, max_num_batched_tokens=40,
        max_num_seqs=MAX_BATCH, block_size=4, enable_prefix_caching=True, **kwargs,
    )  # fmt: skip


class Workload:
    """Two targets (one sampled with its own seed, one greedy) and random companions, some
    sharing the targets' prefix, with random lengths and sampling."""

    def __init__(self, vocab_size: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.prefix = self._tokens(SHARED_PREFIX_TOKENS)
        self.targets = [self.prefix + self._tokens(5), self.prefix[:9] + self._tokens(12)]
        self.target_params = [
            SamplingParams(max_tokens=6, temperature=1.0, seed=1234, logprobs=2, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
        ]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.vocab_size) for _ in range(n)]

    def companion(self) -> tuple[list[int], SamplingParams]:
        shared = self.prefix[: self.rng.randrange(0, SHARED_PREFIX_TOKENS + 1)] if self.rng.random() < 0.5 else []
        prompt = shared + self._tokens(self.rng.randrange(1, 30))
        temperature = self.rng.choice([0.0, 0.7, 1.0])
        seed = self.rng.randrange(1000) if self.rng.random() < 0.5 else None
        params = SamplingParams(
            max_tokens=self.rng.randrange(1, 9), temperature=temperature, seed=seed, ignore_eos=True,
            logprobs=self.rng.choice([None, 0, 3]), top_k=self.rng.choice([0, 20]),
        )  # fmt: skip
        return prompt, params

    def mix(self) -> tuple[list[tuple[list[int], SamplingParams]], list[int]]:
        """A batch with both targets at random places, and their indices in it."""
        batch = [self.companion() for _ in range(self.rng.randrange(0, MAX_BATCH - 1))]
        places = []
        for target, params in zip(self.targets, self.target_params):
            at = self.rng.randrange(len(batch) + 1)
            places = [p + (p >= at) for p in places] + [at]
            batch.insert(at, (target, params))
        return batch, places


def _results(llm: LLM, batch: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    """Each request's token ids and, exactly as floats, its logprobs (token -> logprob, rank)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], [s for _, s in batch], use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in completion.logprobs or []]
        results.append((completion.token_ids, logprobs))
    return results


def _alone(llm: LLM, workload: Workload) -> list[tuple]:
    return [_results(llm, [(t, p)])[0] for t, p in zip(workload.targets, workload.target_params)]


def _mixes_that_differ(llm: LLM, workload: Workload, num_mixes: int) -> list[int]:
    alone = _alone(llm, workload)
    differ = []
    for i in range(num_mixes):
        batch, places = workload.mix()
        results = _results(llm, batch)
        if [results[p] for p in places] != alone:
            differ.append(i)
    if _alone(llm, workload) != alone:  # run after run, with a cache warmed by all the mixes
        differ.append(num_mixes)
    return differ


def test_a_request_is_the_same_alone_and_in_any_batch(tiny_checkpoints: dict[str, Path]) -> None:
    llm = _engine(tiny_checkpoints["llama"], batch_invariant=True)
    assert _mixes_that_differ(llm, Workload(vocab_size=384), NUM_MIXES) == []


def test_the_default_mode_is_not_batch_invariant(tiny_checkpoints: dict[str, Path]) -> None:
    """What the mode is for, on this machine: without it the same workload's logprobs change
    with the batch (the tokens of a model this small mostly do not)."""
    llm = _engine(tiny_checkpoints["llama"], batch_invariant=False)
    assert _mixes_that_differ(llm, Workload(vocab_size=384), 4) != []


def test_a_mixture_of_experts_request_is_the_same_alone_and_in_any_batch(moe_checkpoints: dict[str, Path]) -> None:
    """Qwen3-MoE: each expert's rows are the tokens that chose it, a number the batch decides."""
    llm = _engine(moe_checkpoints["qwen3_moe"], batch_invariant=True)
    assert _mixes_that_differ(llm, Workload(vocab_size=384, seed=1), NUM_MIXES) == []


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_batch_invariance_on_gpu(
    kind: str, tiny_checkpoints: dict[str, Path], moe_checkpoints: dict[str, Path]
) -> None:
    """The Triton kernels end to end, in bfloat16, with the decode steps' CUDA graphs (dense)."""
    path = {**tiny_checkpoints, **moe_checkpoints}[kind]
    llm = _engine(path, batch_invariant=True, device="cuda", dtype="bfloat16")
    assert _mixes_that_differ(llm, Workload(vocab_size=384), NUM_MIXES) == []


def test_unsupported_configurations_are_refused(
    tiny_checkpoints: dict[str, Path], deepseek_checkpoints: dict[str, Path]
) -> None:
    path = str(tiny_checkpoints["llama"])
    with pytest.raises(ValueError, match="float weights only"):
        EngineArgs(path, batch_invariant=True, quantization="fp8").create_engine_config()
    with pytest.raises(ValueError, match="batch_invariant needs kv_cache_dtype"):
        EngineArgs(path, batch_invariant=True, kv_cache_dtype="fp8").create_engine_config()
    with pytest.raises(ValueError, match="multi-head latent attention"):
        LLM(str(deepseek_checkpoints["deepseek_v3"]), multiprocess=False, batch_invariant=True)
    assert EngineArgs(path, batch_invariant=True).create_engine_config().model_config.batch_invariant


@pytest.mark.parametrize(
    "command", [["serve"], ["batch", "-i", "in.jsonl", "-o", "out.jsonl"], ["bench", "throughput"]]
)
def test_the_flag_reaches_the_engine_arguments(command: list[str]) -> None:
    from shoal.cli import engine_args_from, make_parser

    assert engine_args_from(make_parser().parse_args([*command, "--batch-invariant"])).batch_invariant
    assert not engine_args_from(make_parser().parse_args(command)).batch_invariant
