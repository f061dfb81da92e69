"""`worker_extension_cls`: a mixin's methods on every worker, called by `collective_rpc`, reach
the model: a parameter's norm read on each rank adds up to the checkpoint's, and a weight scaled
through it changes the greedy output to what transformers gives on the scaled weights. In one
process (uniproc) here, and on two Ray actors (TP=2) in tests/executors/test_placement.py, whose
engine, placed as a trainer would place it, has the extension too. Bad paths and clashing names
are a ValueError."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.config import EngineArgs

EXTENSION = "tests.workers.weight_probe:WeightProbe"
PARAMETER = "model.layers.0.mlp.down_proj.weight"  # row-parallel: each TP rank holds a slice
FACTOR = 8.0
PROMPT = "The quick brown fox"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@cache
def hf_reference(path: str, prompt_ids: tuple[int, ...]) -> tuple[float, list[int]]:
    """(the parameter's sum of squares, greedy tokens with it scaled by FACTOR) in transformers,
    on a copy of its own (the shared reference model stays as loaded)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    parameter = dict(model.named_parameters())[PARAMETER]
    norm_squared = float(parameter.detach().double().pow(2).sum())
    with torch.no_grad():
        parameter.mul_(FACTOR)
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0
        )
    return norm_squared, out[0, len(prompt_ids) :].tolist()


def greedy(llm: LLM, prompt_ids: list[int]) -> list[int]:
    return llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def check_extension(llm: LLM, path: str, num_workers: int) -> None:
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    norm_squared, scaled_tokens = hf_reference(path, tuple(prompt_ids))
    before = greedy(llm, prompt_ids)
    shards = llm.collective_rpc("parameter_norm_squared", args=(PARAMETER,))
    assert len(shards) == num_workers
    assert sum(shards) == pytest.approx(norm_squared, rel=1e-5)

    assert llm.collective_rpc("scale_parameter", args=(PARAMETER, FACTOR)) == [None] * num_workers
    llm.reset_prefix_cache()  # the cached prompt's KV was computed with the old weights
    after = greedy(llm, prompt_ids)
    assert after != before
    assert after == scaled_tokens
    assert sum(llm.collective_rpc("parameter_norm_squared", args=(PARAMETER,))) == pytest.approx(
        norm_squared * FACTOR**2, rel=1e-5
    )


def test_extension_in_process(tiny_checkpoints: dict) -> None:
    path = str(tiny_checkpoints["llama"])
    with LLM(path, multiprocess=False, worker_extension_cls=EXTENSION) as llm:
        assert type(llm.engine_core.core.executor.worker).__mro__[1].__name__ == "WeightProbe"
        check_extension(llm, path, num_workers=1)


@pytest.mark.parametrize(
    ("path", "error"),
    [
        (
            "tests.workers.weight_probe:Missing",
            "'tests.workers.weight_probe:Missing': module .* has no class 'Missing'",
        ),
        (
            "no_such_package.module:Class",
            "'no_such_package.module:Class': cannot import module 'no_such_package.module'",
        ),
        ("Class", "must look like 'pkg.module:Class'"),
        ("tests.workers.weight_probe:Clashing", r"defines \['load_model'\], which the worker has already"),
    ],
)
def test_bad_extension_is_a_value_error_naming_it(tiny_checkpoints: dict, path: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        EngineArgs(model=str(tiny_checkpoints["llama"]), device="cpu", worker_extension_cls=path).create_engine_config()


def test_vllm_dotted_spelling_and_serve_flag() -> None:
    from shoal.cli import engine_args_from, make_parser
    from shoal.workers.extension import worker_class

    cls: Any = worker_class("tests.workers.weight_probe.WeightProbe")
    assert hasattr(cls, "scale_parameter") and hasattr(cls, "execute_model")
    args = make_parser().parse_args(["serve", "--worker-extension-cls", EXTENSION])
    assert engine_args_from(args).worker_extension_cls == EXTENSION
