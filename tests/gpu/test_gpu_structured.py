"""Structured output on a GPU: the bitmask through pinned staging (two buffers in turn), and a
tiny checkpoint under async scheduling and CUDA graphs, every output valid for its schema and
the same tokens as the engine without async scheduling."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from shoal.step import GrammarBitmask
from shoal.workers.grammar_bitmask import GrammarBitmaskLoader
from tests.structured_output.random_schemas import random_schema

pytestmark = pytest.mark.gpu


def test_bitmasks_through_pinned_staging() -> None:
    loader = GrammarBitmaskLoader(8, torch.device("cuda"))
    rng = np.random.default_rng(0)
    for step in range(5):
        rows = ["b", "d"] if step % 2 else ["a", "b", "c", "d"]
        words = rng.integers(-(2**31), 2**31, size=(len(rows), 3), dtype=np.int64).astype(np.int32)
        grammar = GrammarBitmask(req_ids=rows, bitmask=words.tobytes(), num_words=3)
        bitmask, sampling_rows = loader.load(grammar, ["a", "b", "c", "d"])
        assert bitmask.is_cuda and np.array_equal(bitmask.cpu().numpy(), words)
        assert sampling_rows is None if step % 2 == 0 else sampling_rows.tolist() == [1, 3]


def test_structured_outputs_on_the_gpu(tiny_checkpoints: dict[str, Path]) -> None:
    from shoal import LLM, SamplingParams
    from shoal.sampling_params import StructuredOutputsParams

    path = str(tiny_checkpoints["llama"])
    rng = random.Random(0)
    schemas = [random_schema(rng) for _ in range(16)]
    results = {}
    for async_scheduling in (True, False):
        with LLM(path, max_model_len=512, async_scheduling=async_scheduling, multiprocess=False) as llm:
            tokenizer = llm.get_tokenizer()
            ascii_only = {t: -100.0 for t in range(len(tokenizer)) if not tokenizer.decode([t]).isascii()}
            params = [
                SamplingParams(
                    temperature=1.0,
                    seed=i,
                    max_tokens=300,
                    logit_bias=ascii_only,
                    structured_outputs=StructuredOutputsParams(json=s),
                )
                for i, s in enumerate(schemas)
            ]
            results[async_scheduling] = llm.generate([f"Request {i}" for i in range(16)], params, use_tqdm=False)
    for schema, output in zip(schemas, results[True]):
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    assert [o.outputs[0].token_ids for o in results[True]] == [o.outputs[0].token_ids for o in results[False]]
