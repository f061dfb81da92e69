"""Prefill/decode disaggregation between two engines in one process: a prefill engine saves a
request's KV, a decode engine loads it and continues (shoal/kv_transfer/pd_connector.py,
transport.py, shm_transport.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from shoal import LLM, SamplingParams, envs
from shoal.kv_transfer.params import KV_TRANSFER_FAILED, KVTransferParams

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def engines(tiny_checkpoints: dict) -> tuple[LLM, LLM, LLM]:
    path = str(tiny_checkpoints["llama"])
    common = dict(block_size=BLOCK_SIZE, max_model_len=96)
    return (
        LLM(path, kv_transfer_role="prefill", **common),
        LLM(path, kv_transfer_role="decode", **common),
        LLM(path, enable_prefix_caching=False, **common),
    )


def _transfer_files(transfer_id: str) -> list[Path]:
    return list(Path(envs.SHOAL_KV_TRANSFER_DIR).glob(transfer_id + "*"))


def test_decode_engine_continues_from_the_prefill_engines_kv(engines: tuple[LLM, LLM, LLM]) -> None:
    prefill, decode, single = engines
    prompts = [[(5 * i + 7 * j) % 150 + 3 for j in range(9 + 6 * i)] for i in range(4)]
    prompts.append([*prompts[3][:20], 9, 8, 7])  # a prefix the decode engine then holds itself
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    expected = single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    loaded_before = decode.get_stats()["kv_transfer_tokens_loaded"]
    for prompt, want in zip(prompts, expected, strict=True):
        transfer_id = f"test-{uuid.uuid4().hex}"
        save = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            extra_args=KVTransferParams(transfer_id=transfer_id, role="save").as_extra_args(),
        )
        prefill.generate([{"prompt_token_ids": prompt}], save, use_tqdm=False)
        assert _transfer_files(transfer_id)
        load = KVTransferParams(transfer_id=transfer_id, role="load", num_tokens=len(prompt) - 1)
        ours = decode.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, extra_args=load.as_extra_args()),
            use_tqdm=False,
        )[0]
        assert ours.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) for t in b)
        assert not _transfer_files(transfer_id)  # the decode side released it
    stats = decode.get_stats()
    # Every prompt token but the last came over, less the fifth prompt's local prefix hit.
    assert stats["kv_transfer_tokens_loaded"] - loaded_before == sum(len(p) - 1 for p in prompts) - 20
    assert stats["kv_transfer_failed"] == 0 and stats["num_used_blocks"] == 0
    assert prefill.get_stats()["num_used_blocks"] == 0


def test_a_transfer_that_never_comes_aborts_the_request_in_time(engines: tuple[LLM, LLM, LLM]) -> None:
    _, decode, single = engines
    prompt = [11 + j for j in range(30)]
    load = KVTransferParams(transfer_id=f"missing-{uuid.uuid4().hex}", role="load", num_tokens=29, timeout_s=0.2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, extra_args=load.as_extra_args())
    out = decode.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "abort"
    assert str(out.outputs[0].stop_reason).startswith(KV_TRANSFER_FAILED)
    assert decode.get_stats()["num_used_blocks"] == 0
    # The engine serves on, and the blocks of the failed load left no stale prefix behind.
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    again = decode.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0]
    assert (
        again.outputs[0].token_ids
        == single.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)[0].outputs[0].token_ids
    )
