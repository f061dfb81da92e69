"""Tensor and pipeline parallelism on GPUs through Ray and CuPy NCCL: the same greedy tokens as one
GPU (float32, so that the reduction order cannot flip a token)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_gpu_parallel_matches_one_gpu(ray_cluster: dict, tiny_checkpoints: dict, tp: int, pp: int) -> None:
    import torch

    pytest.importorskip("cupy")
    if torch.cuda.device_count() < tp * pp:
        pytest.skip(f"needs {tp * pp} GPUs")
    from shoal import LLM, SamplingParams

    path = str(tiny_checkpoints["llama_odd_vocab"])
    args = dict(device="cuda", dtype="float32", num_gpu_blocks_override=256, block_size=16, multiprocess=False)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown fox", "Hello world! This is", "one two three four five"]

    single = LLM(path, **args)
    expected = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    single.shutdown()
    parallel = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **args)
    try:
        assert [o.outputs[0].token_ids for o in parallel.generate(prompts, params, use_tqdm=False)] == expected
        assert len(set(parallel.collective_rpc("report_device"))) == tp * pp  # one GPU each, by UUID
    finally:
        parallel.shutdown()
