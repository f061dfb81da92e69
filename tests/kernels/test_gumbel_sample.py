"""`gumbel_sample`: the reference, the Triton kernel under the interpreter (CPU) and on a GPU,
and when the sampler uses it."""

from __future__ import annotations

import pytest
import torch

from shoal.kernels.gumbel_sample import gumbel_sample_ref
from shoal.sampling_params import SamplingParams
from shoal.workers import sampler as sampler_module
from shoal.workers.input_batch import RequestState
from shoal.workers.sampler import Sampler, build_sampling_metadata
from tests.kernels.gumbel_sample_cases import check_across_chunks, check_gumbel_sampler
from tests.kernels.interpreter import needs_triton, run_interpreter_check


def test_reference_samples_the_softmax() -> None:
    assert check_gumbel_sampler(gumbel_sample_ref, torch.device("cpu"), num_rows=4000) == []
    assert check_across_chunks(gumbel_sample_ref, torch.device("cpu"), num_rows=4000) == []


@needs_triton
def test_triton_kernel_under_the_interpreter() -> None:
    run_interpreter_check("tests.kernels.triton_sampling_check")


@needs_triton
@pytest.mark.parametrize(
    "rows, vocab_size, chunks",
    [
        (1, 128256, 63),  # one row: as many chunks as 2,048-logit pieces allow
        (64, 151936, 33),  # towards 16 programs per SM (2,112 on the 132-SM stand-in)
        (256, 151936, 9),
        (2112, 151936, 1),  # the rows alone fill the GPU: one chunk each, no second kernel
        (8, 1000, 1),  # a vocabulary too small to split
    ],
)
def test_rows_are_chunked_until_every_sm_has_16_programs(rows: int, vocab_size: int, chunks: int) -> None:
    from shoal.kernels.triton.sampling import choose_num_chunks

    assert choose_num_chunks(rows, vocab_size, torch.device("cpu")) == chunks


@needs_triton
def test_best_chunk_kernel_has_one_width_per_vocabulary() -> None:
    """Its width is a compile-time constant: one value for every batch size, or a batch that
    shrinks over a run would compile new variants while requests wait."""
    from shoal.kernels.triton.sampling import _chunks_pad, choose_num_chunks

    for vocab_size in (32000, 128256, 151936):
        widths = {
            _chunks_pad(choose_num_chunks(rows, vocab_size, torch.device("cpu")), vocab_size) for rows in range(1, 3000)
        }
        assert len(widths) == 1


@pytest.mark.gpu
def test_triton_kernel_on_gpu() -> None:
    from shoal.kernels.triton.sampling import triton_gumbel_sample

    cuda = torch.device("cuda")
    assert check_gumbel_sampler(triton_gumbel_sample, cuda, num_rows=20000) == []
    assert check_across_chunks(triton_gumbel_sample, cuda, num_rows=100) == []  # chunked: few rows
    assert check_across_chunks(triton_gumbel_sample, cuda, num_rows=20000) == []  # one chunk per row
    # A real vocabulary, bf16 logits: every row draws a valid id.
    logits = torch.randn(256, 151936, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(256, dtype=torch.int64, device="cuda")
    triton_gumbel_sample(out, logits, torch.full((256,), 0.6, device="cuda"), 7)
    assert int(out.min()) >= 0 and int(out.max()) < 151936


def states(*params: SamplingParams) -> list[RequestState]:
    """As the input batch builds them: a seeded request brings its own generator."""
    return [
        RequestState(str(i), i, 1, p, None, None if p.seed is None else torch.Generator().manual_seed(p.seed))
        for i, p in enumerate(params)
    ]


@pytest.mark.parametrize(
    "params, fused",
    [
        ((SamplingParams(temperature=0.6), SamplingParams(temperature=1.0)), True),
        ((SamplingParams(temperature=0.6), SamplingParams(temperature=0.0)), True),  # greedy rows: argmax after
        ((SamplingParams(temperature=0.6, top_k=5),), False),
        ((SamplingParams(temperature=0.6, top_p=0.9),), False),
        ((SamplingParams(temperature=0.6, min_p=0.1),), False),
        ((SamplingParams(temperature=0.6, seed=3),), False),  # a request's own generator
        ((SamplingParams(temperature=0.6, logprobs=2),), False),  # logprobs need the float32 softmax
        ((SamplingParams(temperature=0.6, repetition_penalty=1.2),), False),
        ((SamplingParams(temperature=0.6, min_tokens=4),), False),
        ((SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)), False),  # all greedy: argmax
    ],
)
def test_sampler_takes_the_fused_kernel_for_plain_temperature_batches(monkeypatch, params, fused: bool) -> None:
    calls = []

    def fake_kernel(out, logits, temperature, seed):
        calls.append(seed)
        gumbel_sample_ref(out, logits, temperature, seed)

    monkeypatch.setattr(sampler_module, "fused_sampling_kernel", lambda logits: fake_kernel)
    logits = torch.randn(len(params), 50)
    metadata = build_sampling_metadata(states(*params), 50, torch.device("cpu"))
    sampled = Sampler()(logits, metadata).sampled_token_ids
    assert len(calls) == int(fused)
    for row, p in enumerate(params):
        if p.greedy:
            assert int(sampled[row]) == int(logits[row].argmax())
