"""The hardware-bound model: shapes from configs, the workload as steps, and the bound, on cases
small enough to check by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.bench.hardware import (
    DeviceCeilings,
    ModelShape,
    StepLoad,
    measure_ceilings,
    prefill_piece_pairs,
    simulate_steps,
    workload_bound,
)

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"

# A made-up model and device with round numbers.
SHAPE = ModelShape(
    num_layers=2,
    num_heads=4,
    head_dim=8,
    layer_params=1000,
    embed_params=500,
    lm_head_params=500,
    tied_embeddings=False,
    weight_bytes=3000,
    kv_bytes_per_token=64,
)
CEILINGS = DeviceCeilings(
    "cpu",
    "test",
    read_bytes_per_s=1000.0,
    copy_bytes_per_s=900.0,
    gemm_flops_per_s=1e6,
    gemm_dtype="float32",
    gemm_size=1,
)


def test_one_prompt_then_one_decode_step_by_hand() -> None:
    steps = simulate_steps([9], [2], max_num_seqs=8, max_num_batched_tokens=16)
    assert steps == [StepLoad(9, 1, 9, 45, True), StepLoad(1, 1, 10, 10, False)]
    bound = workload_bound(SHAPE, CEILINGS, steps)
    # Prefill: weights 3000 B + KV (9 read + 9 written) × 64 B = 4152 B → 4.152 s; its flops
    # (2·1000·9 + 2·500·1 + 4·2·4·8·45 = 30,520) take 0.03 s.
    assert bound.prefill_s == pytest.approx(4.152)
    # Decode: weights 3000 B + KV (10 read + 1 written) × 64 B = 3704 B → 3.704 s.
    assert bound.decode_s == pytest.approx(3.704)
    assert bound.bound_s == pytest.approx(7.856)
    assert bound.num_steps == 2 and bound.num_memory_bound_steps == 2
    assert bound.total_flops == 2 * 1000 * 9 + 2 * 500 + 256 * 45 + 2 * 1000 + 2 * 500 + 256 * 10


def test_compute_bound_step() -> None:
    slow_gemm = DeviceCeilings(
        "cpu",
        "test",
        read_bytes_per_s=1e12,
        copy_bytes_per_s=9e11,
        gemm_flops_per_s=1000.0,
        gemm_dtype="float32",
        gemm_size=1,
    )
    bound = workload_bound(SHAPE, slow_gemm, [StepLoad(1, 1, 10, 10, False)])
    assert bound.bound_s == pytest.approx((2 * 1000 + 2 * 500 + 256 * 10) / 1000.0)
    assert bound.num_memory_bound_steps == 0
    half = workload_bound(SHAPE, slow_gemm, [StepLoad(1, 1, 10, 10, False)], tensor_parallel_size=2)
    assert half.bound_s == pytest.approx(bound.bound_s / 2)


def test_prefill_is_chunked_by_the_token_budget() -> None:
    steps = simulate_steps([5, 7], [1, 1], max_num_seqs=8, max_num_batched_tokens=4)
    # Step 1: prompt 0 tokens [0, 4). Step 2: prompt 0 [4, 5) and prompt 1 [0, 3). Step 3: prompt 1 [3, 7).
    assert [s.num_tokens for s in steps] == [4, 4, 4]
    assert [s.num_sampled for s in steps] == [0, 1, 1]
    assert [s.kv_read_tokens for s in steps] == [4, 5 + 3, 7]
    assert [s.attention_pairs for s in steps] == [10, prefill_piece_pairs(4, 1) + 6, prefill_piece_pairs(3, 4)]
    assert prefill_piece_pairs(4, 1) == 5 and prefill_piece_pairs(3, 4) == 22
    assert all(s.is_prefill for s in steps)


def test_decode_batch_shrinks_and_waits_for_room() -> None:
    steps = simulate_steps([4, 4, 4], [3, 2, 4], max_num_seqs=2, max_num_batched_tokens=64)
    decode = [s for s in steps if not s.is_prefill]
    # Requests decode 2, 1 and 3 tokens; the third starts once the second finishes.
    assert [s.num_tokens for s in decode] == [2, 2, 1, 1]
    assert sum(s.num_tokens for s in decode) == (3 - 1) + (2 - 1) + (4 - 1)
    # Step 1: contexts 5 + 5; step 2: 6 + 5 (request 2 joins); steps 3, 4: 6, 7.
    assert [s.kv_read_tokens for s in decode] == [10, 11, 6, 7]


def test_shapes_match_transformers(tiny_checkpoints: dict[str, Path]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for kind in ("llama", "qwen2", "qwen3", "llama_odd_vocab"):
        config = AutoConfig.from_pretrained(tiny_checkpoints[kind])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shape = ModelShape.from_hf_config(config, "float32")
        assert shape.num_params == model.num_parameters(), kind


def test_moe_shapes_match_transformers(moe_checkpoints: dict[str, Path]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for kind, path in moe_checkpoints.items():
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert ModelShape.from_hf_config(config, "float32").num_params == model.num_parameters(), kind


def test_mla_shapes_match_transformers(deepseek_checkpoints: dict[str, Path]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for kind, path in deepseek_checkpoints.items():
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        shape = ModelShape.from_hf_config(config, "float32")
        assert shape.num_params == model.num_parameters(), kind
        assert shape.kv_bytes_per_token == 3 * (32 + 8) * 4  # one latent a layer


@pytest.mark.parametrize(
    ("name", "num_params", "num_moe_layers"),
    [
        ("deepseek-v2-lite", 15_706_484_224, 26),
        ("deepseek-v3", 671_026_404_352, 58),
        ("deepseek-v3-8layer", 61_140_245_504, 5),
    ],
)
def test_shipped_deepseek_configs(name: str, num_params: int, num_moe_layers: int) -> None:
    """V2-Lite's 15.7B and V3's 671B (without its multi-token-prediction layer); the cache holds
    512 + 64 values a layer and token, whatever the heads."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(CONFIGS / name)
    shape = ModelShape.from_hf_config(config, "bfloat16")
    assert (shape.num_params, shape.num_moe_layers) == (num_params, num_moe_layers)
    assert shape.kv_bytes_per_token == config.num_hidden_layers * 576 * 2
    assert shape.attention_flops_per_pair == config.num_hidden_layers * config.num_attention_heads * (2 * 576 + 2 * 512)


def test_a_moe_step_reads_the_experts_its_tokens_touch() -> None:
    from transformers import AutoConfig

    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(CONFIGS / "qwen3-30b-a3b"), "bfloat16")
    assert (shape.num_moe_layers, shape.num_experts, shape.experts_per_token) == (48, 128, 8)
    assert shape.experts_touched(1) == 8 and 127.9 < shape.experts_touched(1024) <= 128
    active = shape.layer_params + shape.embed_params + shape.lm_head_params
    assert 3.3e9 < active < 3.4e9  # "A3B": 3.3B parameters a token goes through
    expert_layer_bytes = 48 * shape.expert_bytes
    assert shape.weight_bytes_for(1) == pytest.approx(shape.weight_bytes + 8 * expert_layer_bytes)
    assert shape.weight_bytes_for(4096) == pytest.approx(shape.weight_bytes + 128 * expert_layer_bytes)


def test_block_fp8_checkpoints_read_their_experts_in_fp8() -> None:
    """The 8-layer DeepSeek-V3 ships block-wise fp8: experts and linear layers are one byte a
    parameter and a float32 scale per 128 x 128 block; norms and the LM head stay bfloat16."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(CONFIGS / "deepseek-v3-8layer")
    bf16, fp8 = (
        ModelShape.from_hf_config(config, "bfloat16"),
        ModelShape.from_hf_config(config, "bfloat16", "auto", "fp8"),
    )
    assert bf16.expert_bytes == 2 * bf16.expert_params
    assert fp8.expert_bytes == round(fp8.expert_params * (1 + 4 / 128**2))
    assert fp8.lm_head_params * 2 < fp8.weight_bytes < bf16.weight_bytes / 1.5
    # Their products run in fp8: every per-token parameter but the norms (and the LM head, not
    # in layer_params); none of the bf16 shape's.
    assert bf16.fp8_params == 0 and 0.99 * fp8.layer_params < fp8.fp8_params < fp8.layer_params


def test_fp8_flops_take_the_fp8_gemm_rate() -> None:
    """A compute-bound step: its fp8 flops at the fp8 rate, the rest (LM head, attention) at the
    GEMM rate; without an fp8 rate everything at the GEMM rate."""
    import dataclasses

    shape = dataclasses.replace(SHAPE, fp8_params=600)
    slow = DeviceCeilings("cpu", "test", 1e12, 9e11, gemm_flops_per_s=1000.0, gemm_dtype="x", gemm_size=1)
    step = StepLoad(1, 1, 10, 10, False)
    all_at_gemm_rate = (2 * 1000 + 2 * 500 + 256 * 10) / 1000.0
    assert workload_bound(shape, slow, [step]).bound_s == pytest.approx(all_at_gemm_rate)
    fast_fp8 = dataclasses.replace(slow, fp8_gemm_flops_per_s=2000.0)
    bound = workload_bound(shape, fast_fp8, [step])
    assert bound.bound_s == pytest.approx(all_at_gemm_rate - 2 * 600 / 2000.0)
    # In series the fp8 flops belong to the weight phase.
    assert bound.serial_bound_s == pytest.approx((2 * 400 + 2 * 500) / 1000.0 + 2 * 600 / 2000.0 + 2560 / 1000.0)


@pytest.mark.parametrize(
    ("name", "num_params", "kv_kib_per_token"),
    [
        ("llama-3.1-8b", 8_030_261_248, 128),
        ("qwen3-0.6b", 596_049_920, 112),
        ("qwen3-8b", 8_190_735_360, 144),
        ("qwen3-30b-a3b", 30_532_122_624, 96),
        ("mixtral-8x7b", 46_702_792_704, 128),
    ],
)
def test_shipped_configs(name: str, num_params: int, kv_kib_per_token: int) -> None:
    from shoal.config import EngineArgs

    config = EngineArgs(
        model=str(CONFIGS / name), load_format="dummy", device="cpu", dtype="bfloat16"
    ).create_engine_config()
    shape = ModelShape.from_hf_config(config.model_config.hf_config, "bfloat16")
    assert shape.num_params == num_params
    assert shape.kv_bytes_per_token == kv_kib_per_token * 1024
    assert not (CONFIGS / name / "model.safetensors").exists()


def test_measure_ceilings_on_cpu() -> None:
    ceilings = measure_ceilings("cpu", "float32", copy_bytes=8 << 20, gemm_size=256)
    assert ceilings.read_bytes_per_s > 1e8 and ceilings.copy_bytes_per_s > 1e8 and ceilings.gemm_flops_per_s > 1e7
    assert (ceilings.device, ceilings.gemm_dtype, ceilings.gemm_size) == ("cpu", "float32", 256)


def test_serial_bound_charges_the_weight_and_attention_phases_one_after_the_other() -> None:
    ceilings = DeviceCeilings(
        "cpu", "test", read_bytes_per_s=1e4, copy_bytes_per_s=9e3, gemm_flops_per_s=1e5, gemm_dtype="x", gemm_size=1
    )
    step = StepLoad(num_tokens=100, num_sampled=100, kv_read_tokens=1000, attention_pairs=1000, is_prefill=False)
    bound = workload_bound(SHAPE, ceilings, [step])
    # Together: bytes 3000 + 64 × 1100 = 73,400 → 7.34 s beat flops 300,000 + 256,000 → 5.56 s.
    assert bound.bound_s == pytest.approx(7.34)
    # In series: GEMMs 300,000 flops → 3.0 s (weights 0.3 s), then attention 70,400 B → 7.04 s.
    assert bound.serial_bound_s == pytest.approx(10.04)
    one_step = workload_bound(SHAPE, CEILINGS, simulate_steps([9], [2], 8, 16))
    assert one_step.serial_bound_s >= one_step.bound_s
