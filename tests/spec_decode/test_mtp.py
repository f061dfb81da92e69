"""DeepSeek-V3's next-token module (shoal/models/deepseek_mtp.py) and the MTP proposer
(shoal/spec_decode/mtp.py) on a tiny DeepSeek-V3 whose checkpoint carries one module after its
decoder layers (tests/spec_decode/drafter_checkpoints.py): loading from the target's checkpoint
(the target's loader still skips it) with the target's embedding and head; its forward through the
latent cache against a reference around transformers' decoder layer
(tests/spec_decode/drafter_reference.py), in float and from a block-fp8 checkpoint; the proposer's
drafts over chunked prefills, partial acceptances and a prefix-cache hit against the reference's
greedy chain; RL updates by the target's names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shoal.forward_context import set_forward_context
from shoal.kernels.scaled_fp8_quant import FP8_DTYPE
from shoal.layers.quantization.base import UnquantizedLinearMethod
from shoal.layers.quantization.fp8_block import Fp8BlockLinearMethod
from shoal.layers.quantization.fp8_block_moe import Fp8BlockMoEMethod
from shoal.models.deepseek import DeepseekMoE
from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.mtp import MtpProposer
from shoal.spec_decode.proposer import make_proposer
from tests.kernels.metadata_utils import allocate_block_tables, make_attention_metadata
from tests.models.block_fp8_checkpoints import hf_block_fp8_model, write_block_fp8_checkpoint
from tests.models.model_utils import load_shoal
from tests.spec_decode.draft_steps import DraftSteps
from tests.spec_decode.drafter_reference import MtpReference, reference_drafts

K = 3
BLOCK_SIZE = 4
ATOL = 1e-4
FP8_BLOCK = (16, 16)
FP8_ATOL = 5e-3  # as tests/models/test_fp8_block_models.py: float32 summation order across e4m3 roundings
MTP = "model.layers.3."


def load_mtp(path, k: int = K) -> tuple[torch.nn.Module, MtpProposer]:
    target = load_shoal(path)
    proposer = make_proposer(
        SpeculativeConfig(method="mtp", num_speculative_tokens=k), block_size=BLOCK_SIZE, target_path=str(path)
    )
    assert isinstance(proposer, MtpProposer)
    proposer.load_model(target)
    return target, proposer


def hf_hidden(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the norm) at every position [T, hidden]."""
    with torch.no_grad():
        return hf.model(torch.tensor([tokens])).last_hidden_state[0]


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_module_loads_from_the_targets_checkpoint(deepseek_mtp):
    target, proposer = load_mtp(deepseek_mtp)
    module, w = proposer.drafter, load_file(deepseek_mtp / "model.safetensors")
    layer = module.model.layers["3"]
    assert not any(name.startswith("model.layers.3") for name, _ in target.named_parameters())  # still skipped
    assert module.embed_tokens is target.model.embed_tokens and module.lm_head is target.lm_head
    assert torch.equal(layer.eh_proj.weight, w[f"{MTP}eh_proj.weight"]) and layer.eh_proj.weight.shape == (64, 128)
    assert torch.equal(layer.enorm.weight, w[f"{MTP}enorm.weight"])
    assert torch.equal(layer.shared_head.norm.weight, w[f"{MTP}shared_head.norm.weight"])
    assert torch.equal(layer.self_attn.q_a_proj.weight, w[f"{MTP}self_attn.q_a_proj.weight"])
    assert isinstance(layer.mlp, DeepseekMoE)  # past first_k_dense_replace, as V3's layer 61
    assert torch.equal(layer.mlp.gate.e_score_correction_bias, w[f"{MTP}mlp.gate.e_score_correction_bias"])
    assert proposer.kv_cache_block_bytes() == BLOCK_SIZE * (32 + 8) * 4  # one latent a token


def test_the_modules_forward_matches_the_reference(deepseek_mtp):
    """Eleven positions as a prefill chunk, a chunk after it (reading the cached latents back) and
    a decode (absorbed attention) against the reference over the whole sequence."""
    _, proposer = load_mtp(deepseek_mtp)
    _check_forward(proposer.drafter, MtpReference(deepseek_mtp), proposer, ATOL)


def _check_forward(module, reference, proposer, atol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 64, generator=gen)
    tokens = torch.randint(0, 384, (11,), generator=gen)
    proposer.initialize_kv_cache(8)
    tables = allocate_block_tables([11], BLOCK_SIZE, 8, gen)
    outputs = []
    with torch.inference_mode():
        for start, end in [(0, 6), (6, 10), (10, 11)]:
            md = make_attention_metadata([end - start], [end], tables, BLOCK_SIZE)
            with set_forward_context(md):
                outputs.append(module(tokens[start:end], torch.arange(start, end), hidden[start:end]))
        out = torch.cat(outputs)
        expected = reference(hidden, tokens, torch.arange(11))
        torch.testing.assert_close(out, expected, rtol=0, atol=atol)
        torch.testing.assert_close(module.compute_logits(out), reference.logits(expected), rtol=0, atol=atol)


@pytest.mark.parametrize("lookahead", [0, K - 1], ids=["step-slots-only", "lookahead-slots"])
def test_drafts_follow_the_references_greedy_chain(deepseek_mtp, lookahead):
    """As the EAGLE-3 test: A in two chunks, B decoding (greedy, then all accepted), C a
    prefix-cache hit on A's first two blocks; MLA's latent cache under the prefills, the chunk
    after a cached prefix and the chain's absorbed decodes."""
    target, proposer = load_mtp(deepseek_mtp)
    reference = MtpReference(deepseek_mtp)
    hf = AutoModelForCausalLM.from_pretrained(deepseek_mtp, dtype=torch.float32, attn_implementation="eager").eval()
    steps = DraftSteps(target, proposer, block_size=BLOCK_SIZE, lookahead=lookahead)
    a, b = random_tokens(11, seed=2), random_tokens(6, seed=3)
    steps.add(2, a)
    steps.add(0, b)
    drafts = _check(steps, reference, hf, steps.step(prefill={2: 7, 0: 6}))
    drafts = _check(steps, reference, hf, steps.step(prefill={2: 4}, verify=drafts))
    steps.add(1, a[:9] + random_tokens(3, seed=4), shared_from=2, num_cached_blocks=2)
    accept = {2: 1, 0: len(drafts[0])}
    drafts = _check(steps, reference, hf, steps.step(prefill={1: 4}, verify=drafts, accept=accept))
    assert sorted(drafts) == [0, 1, 2]
    drafts = _check(steps, reference, hf, steps.step(verify=drafts))
    if lookahead:
        assert all(len(d) == K for d in drafts.values())


def _check(steps: DraftSteps, reference, hf, drafts: dict[int, list[int]]) -> dict[int, list[int]]:
    for slot, proposed in drafts.items():
        tokens = steps.tokens(slot)
        owned_past_last = int(steps.num_blocks[slot]) * BLOCK_SIZE - (len(tokens) - 2)
        assert len(proposed) == min(K, owned_past_last), (slot, tokens)
        expected = reference_drafts(reference, hf_hidden(hf, tokens[:-1]), tokens, K)
        assert proposed == expected[: len(proposed)], (slot, tokens)
    return drafts


def test_the_module_of_a_block_fp8_checkpoint(deepseek_mtp, tmp_path):
    """The module's decoder layer is fp8 as the target's layers are (eh_proj stays float, as
    stored), and computes what transformers computes on the dequantized weights with the
    activations rounded as shoal rounds them."""
    path = write_block_fp8_checkpoint(deepseek_mtp, tmp_path / "fp8", FP8_BLOCK)
    _, proposer = load_mtp(path)
    layer = proposer.drafter.model.layers["3"]
    assert isinstance(layer.self_attn.q_b_proj.linear_method, Fp8BlockLinearMethod)
    assert layer.self_attn.kv_b_proj.weight.dtype == FP8_DTYPE
    assert isinstance(layer.mlp.experts.moe_method, Fp8BlockMoEMethod)
    assert isinstance(layer.eh_proj.linear_method, UnquantizedLinearMethod)
    hf = hf_block_fp8_model(path, FP8_BLOCK, num_hidden_layers=4)
    reference = MtpReference(path, hf)
    _check_forward(proposer.drafter, reference, proposer, FP8_ATOL)


def test_rl_updates_by_the_targets_names(deepseek_mtp):
    """The module takes its own tensors of a target update (model.layers.3.*) and leaves the
    rest to the target; the shared embedding's update is the module's too."""
    target, proposer = load_mtp(deepseek_mtp)
    gen = torch.Generator().manual_seed(9)
    new_eh_proj = torch.randn(64, 128, generator=gen)
    new_q_a = torch.randn(48, 64, generator=gen)
    new_expert = torch.randn(32, 64, generator=gen)
    new_embedding = torch.randn(384, 64, generator=gen)
    update = [
        ("model.embed_tokens.weight", new_embedding),
        ("model.layers.0.self_attn.q_a_proj.weight", torch.zeros(48, 64)),
        (f"{MTP}eh_proj.weight", new_eh_proj),
        (f"{MTP}self_attn.q_a_proj.weight", new_q_a),
        (f"{MTP}mlp.experts.5.gate_proj.weight", new_expert),
        (f"{MTP}embed_tokens.weight", torch.zeros(384, 64)),  # the checkpoint's copy of the shared one
    ]
    target.load_weights(update)
    loaded = proposer.load_weights(update)
    assert loaded == {f"{MTP}eh_proj.weight", f"{MTP}self_attn.q_a_proj.weight", f"{MTP}mlp.experts.w13_weight"}
    layer = proposer.drafter.model.layers["3"]
    assert torch.equal(layer.eh_proj.weight, new_eh_proj) and torch.equal(layer.self_attn.q_a_proj.weight, new_q_a)
    assert torch.equal(proposer.drafter.embed_tokens.weight, new_embedding)
    assert not torch.equal(target.model.layers["0"].self_attn.q_a_proj.weight, new_q_a)


def test_a_checkpoint_without_the_module_is_refused(deepseek_checkpoints):
    with pytest.raises(ValueError, match="has no multi-token-prediction layer"):
        load_mtp(deepseek_checkpoints["deepseek_v3"])
