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


def test_gpu_worker_killed_mid_generate_is_restarted(ray_cluster: dict, tiny_checkpoints: dict) -> None:
    """TP=2 on two GPUs, rank 1 killed while a batch decodes: the survivor, blocked in an NCCL
    all-reduce with the dead rank, is re-created too (NCCL cannot abort it), the CUDA graphs are
    captured again over new communicators, and the greedy tokens are those of an undisturbed run."""
    import threading
    import time

    import ray
    import torch

    pytest.importorskip("cupy")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from shoal import LLM, SamplingParams

    path = str(tiny_checkpoints["llama_odd_vocab"])
    llm = LLM(
        path, tensor_parallel_size=2, device="cuda", dtype="float32", num_gpu_blocks_override=2048, multiprocess=False
    )
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    prompts = [f"prompt number {i}: the quick brown fox" for i in range(64)]
    try:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        start = time.monotonic()
        llm.generate(prompts, params, use_tqdm=False)
        undisturbed_s = time.monotonic() - start
        executor = llm.engine_core.core.executor
        killer = threading.Timer(undisturbed_s / 3, ray.kill, (executor.workers[1],))
        killer.start()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        killer.join()
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert llm.get_stats()["num_worker_restarts"] == 1  # the kill landed mid-generate
        assert len(set(llm.collective_rpc("report_device"))) == 2
    finally:
        llm.shutdown()
