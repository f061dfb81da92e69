"""DeepSeek-V2 and V3 against Hugging Face transformers on tiny random checkpoints
(tests/checkpoints.py DEEPSEEK_KINDS): logits of a batched prefill, and of chunked prefills beside
decodes (chunks after a cached prefix read their context's latents back from the cache, decodes
run absorbed); the latent cache; the layers of each config; each rank's shard of MLA under
tensor parallelism; the multi-token-prediction layers skipped; dummy weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shoal.layers.mla import MLAAttention
from shoal.models.deepseek import DeepseekMoE
from shoal.models.llama import LlamaMLP
from tests.checkpoints import DEEPSEEK_KINDS
from tests.layers.tp_utils import fake_tp_group
from tests.models.model_utils import PagedRunner, hf_logits, load_shoal

ATOL = 1e-4


def _sequences(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("kind", DEEPSEEK_KINDS)
def test_prefill_then_chunks_and_decodes_match_hf(deepseek_checkpoints, kind):
    """A batched prefill of three prompts; then A in two chunks and decodes beside B's decodes."""
    path = deepseek_checkpoints[kind]
    model = load_shoal(path)
    sequences = _sequences(model.config.vocab_size, [5, 11, 17])
    a, b = _sequences(model.config.vocab_size, [14, 8], seed=1)
    *expected, expected_a, expected_b = hf_logits(path, [*sequences, a, b])
    logits = PagedRunner(model, [len(s) for s in sequences]).step(sequences, [(0, len(s)) for s in sequences])
    for ours, theirs in zip(logits, expected):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    runner = PagedRunner(load_shoal(path), [len(a), len(b)])
    for chunks in [[(0, 5), (0, 6)], [(5, 13), (6, 7)], [(13, 14), (7, 8)]]:
        ours = runner.step([a, b], chunks)
        (sa, ea), (sb, eb) = chunks
        torch.testing.assert_close(ours[0], expected_a[sa:ea], rtol=0, atol=ATOL)
        torch.testing.assert_close(ours[1], expected_b[sb:eb], rtol=0, atol=ATOL)


def test_the_cache_holds_the_latent_of_every_token(deepseek_checkpoints):
    """One latent row of kv_lora_rank + qk_rope_head_dim values per token, for all heads: the
    normalized c_kv then the rotated k_pe, as the reference computes them."""
    model = load_shoal(deepseek_checkpoints["deepseek_v3"])
    layer = model.attention_layers()[0]
    assert isinstance(layer, MLAAttention) and layer.kv_cache_spec.shape(7, 4) == (1, 7, 4, 1, 32 + 8)
    tokens = _sequences(model.config.vocab_size, [6])[0]
    runner = PagedRunner(model, [6])
    runner.step([tokens], [(0, 6)])
    hidden = model.model.embed_tokens(torch.tensor(tokens))
    normed = model.model.layers["0"].input_layernorm(hidden)
    kv_c, k_pe = layer.kv_a_proj_with_mqa(normed).split([32, 8], dim=-1)
    kv_c = layer.kv_a_layernorm(kv_c.contiguous())
    _, k_pe = layer.rotary_emb(torch.arange(6), torch.zeros(6, 8), k_pe.contiguous())
    slots = [block * 4 + offset for block in runner.block_tables[0] for offset in range(4)][:6]
    cached = layer.kv_cache.view(-1, 40)[slots]
    torch.testing.assert_close(cached, torch.cat((kv_c, k_pe), dim=-1), rtol=0, atol=1e-6)


def test_layers_have_the_mlps_and_routing_of_their_config(deepseek_checkpoints):
    v2 = load_shoal(deepseek_checkpoints["deepseek_v2"])
    layers = v2.model.layers
    assert isinstance(layers["0"].mlp, LlamaMLP)  # first_k_dense_replace=1
    assert all(isinstance(layers[i].mlp, DeepseekMoE) for i in ("1", "2"))
    routing = layers["1"].mlp.gate.routing
    assert (routing.scoring_func, routing.topk_method, routing.renormalize) == (
        "softmax",
        "group_limited_greedy",
        False,
    )
    assert layers["1"].mlp.shared_experts.gate_up_proj.weight.shape == (2 * 2 * 32, 64)  # 2 shared experts
    assert layers["0"].self_attn.q_lora_rank is None and layers["0"].self_attn.scale > 24**-0.5  # yarn mscale
    v3 = load_shoal(deepseek_checkpoints["deepseek_v3"]).model.layers
    gate = v3["1"].mlp.gate
    assert (gate.routing.scoring_func, gate.routing.topk_method, gate.routing.renormalize) == (
        "sigmoid",
        "noaux_tc",
        True,
    )
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.abs().min() > 0
    assert v3["0"].self_attn.q_lora_rank == 48 and v3["0"].self_attn.rotary_emb.is_neox_style is False


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_splits_the_heads(deepseek_checkpoints, rank):
    path = deepseek_checkpoints["deepseek_v3"]
    hf = load_file(path / "model.safetensors")
    with fake_tp_group(rank):
        attn = load_shoal(path).model.layers["1"].self_attn
    p = "model.layers.1.self_attn."
    assert attn.num_heads == 2
    # q_b_proj rows: 2 heads of 24; kv_b_proj rows: 2 heads of 16 + 16; o_proj columns: 2 heads of 16.
    assert torch.equal(attn.q_b_proj.weight, hf[f"{p}q_b_proj.weight"][48 * rank : 48 * rank + 48])
    assert torch.equal(attn.kv_b_proj.weight, hf[f"{p}kv_b_proj.weight"][64 * rank : 64 * rank + 64])
    assert torch.equal(attn.o_proj.weight, hf[f"{p}o_proj.weight"][:, 32 * rank : 32 * rank + 32])
    # The down-projections and the latent are whole on every rank.
    assert torch.equal(attn.kv_a_proj_with_mqa.weight, hf[f"{p}kv_a_proj_with_mqa.weight"])
    assert torch.equal(attn.q_a_proj.weight, hf[f"{p}q_a_proj.weight"])


def test_multi_token_prediction_layers_are_skipped(deepseek_checkpoints, tmp_path, shoal_log):
    """A V3 checkpoint with a next-token-prediction layer after its 3 decoder layers (as the
    released model's `model.layers.61`) loads the same model."""
    source = deepseek_checkpoints["deepseek_v3"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        shutil.copy(source / name, tmp_path / name)
    tensors = load_file(source / "model.safetensors")
    mtp = {n.replace("model.layers.2.", "model.layers.3."): t for n, t in tensors.items() if ".layers.2." in n}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(mtp, tmp_path / "model-mtp.safetensors")
    original, with_mtp = load_shoal(source), load_shoal(tmp_path)
    assert "skipped the multi-token-prediction layers [3]" in shoal_log.text
    for (name, a), (_, b) in zip(original.named_parameters(), with_mtp.named_parameters()):
        assert torch.equal(a, b), name


def test_dummy_weights_from_a_config_only(deepseek_checkpoints, tmp_path):
    shutil.copy(deepseek_checkpoints["deepseek_v2"] / "config.json", tmp_path / "config.json")
    model = load_shoal(tmp_path, load_format="dummy")
    logits = PagedRunner(model, [7]).step([[1, 2, 3, 4, 5, 6, 7]], [(0, 7)])[0]
    assert logits.shape == (7, model.config.vocab_size) and torch.isfinite(logits).all()
