"""The EAGLE-3 head (shoal/models/llama_eagle3.py) and its proposer (shoal/spec_decode/eagle.py) on
the tiny Llama target, with a head written in the published layout
(tests/spec_decode/drafter_checkpoints.py): the target's auxiliary hidden states against
transformers' hidden states, the head's loading and tying, its forward through the paged cache
against a plain reference of the architecture (tests/spec_decode/drafter_reference.py), the drafts
of the proposer over chunked prefills, partial acceptances and a prefix-cache hit against the
reference's greedy chain, and an RL update of the target's embedding seen by the tied head."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shoal.forward_context import set_forward_context
from shoal.models.llama_eagle3 import eagle3_aux_layers
from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.eagle import Eagle3Proposer
from shoal.spec_decode.proposer import ProposerInputs, make_proposer
from tests.kernels.metadata_utils import allocate_block_tables, make_attention_metadata
from tests.models.model_utils import load_shoal
from tests.spec_decode.draft_steps import DraftSteps
from tests.spec_decode.drafter_checkpoints import EAGLE3_AUX_LAYERS
from tests.spec_decode.drafter_reference import Eagle3Reference, EagleReference, reference_drafts

K = 3
BLOCK_SIZE = 4
ATOL = 1e-4


def load_eagle3(head, target_path, k: int = K) -> tuple[torch.nn.Module, Eagle3Proposer]:
    target = load_shoal(target_path)
    proposer = make_proposer(
        SpeculativeConfig(method="eagle3", num_speculative_tokens=k, model=str(head)), block_size=BLOCK_SIZE
    )
    assert isinstance(proposer, Eagle3Proposer)
    proposer.load_model(target)
    return target, proposer


def hf_features(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' residual stream entering layers 0, 1 and 2 at every position [T, 3 * hidden]."""
    with torch.no_grad():
        hidden_states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    return torch.cat([hidden_states[i][0] for i in EAGLE3_AUX_LAYERS], dim=-1)


def random_tokens(n: int, seed: int, vocab_size: int = 384) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_target_returns_the_features_of_the_heads_layers(tiny_checkpoints):
    """Off by default; set, the forward returns the residual stream entering the layers beside the
    unchanged output."""
    path = tiny_checkpoints["llama"]
    target = load_shoal(path)
    tokens = random_tokens(9, seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected_logits = hf(torch.tensor([tokens])).logits[0]
    for layer in target.attention_layers():
        layer.kv_cache = layer.kv_cache_spec.allocate(8, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    md = make_attention_metadata([9], [9], allocate_block_tables([9], BLOCK_SIZE, 8), BLOCK_SIZE)
    with set_forward_context(md), torch.inference_mode():
        assert isinstance(target(torch.tensor(tokens), torch.arange(9)), torch.Tensor)
        target.set_aux_hidden_state_layers((2, 0, 1))
        hidden, aux = target(torch.tensor(tokens), torch.arange(9))
        logits = target.compute_logits(hidden)
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=ATOL)
    torch.testing.assert_close(aux, hf_features(hf, tokens), rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match=r"must lie in \[0, 3\]"):
        target.set_aux_hidden_state_layers((1, 4))


def test_the_published_choice_of_feature_layers():
    assert eagle3_aux_layers(SimpleNamespace(), 32) == (2, 16, 29)  # Llama-3.1-8B's 32 layers
    config = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 9]})
    assert eagle3_aux_layers(config, 32) == (1, 5, 9)
    assert eagle3_aux_layers(SimpleNamespace(eagle_aux_hidden_state_layer_ids=[3, 4, 5]), 32) == (3, 4, 5)


def test_the_head_loads_the_published_layout_tied_to_the_target(eagle3_head, tiny_checkpoints):
    target, proposer = load_eagle3(eagle3_head, tiny_checkpoints["llama"])
    head = proposer.drafter
    w = load_file(eagle3_head / "model.safetensors")
    assert "embed_tokens.weight" not in w and head.embed_tokens is target.model.embed_tokens
    assert head.lm_head is not target.lm_head and head.lm_head.num_embeddings == 128  # the draft vocabulary
    q, k, v = (w[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv")
    assert q.shape == (64, 128)  # the attention reads [embedding; hidden]
    assert torch.equal(head.midlayer.self_attn.qkv_proj.weight, torch.cat((q, k, v)))
    assert torch.equal(head.fc.weight, w["fc.weight"]) and head.fc.weight.shape == (64, 192)
    assert torch.equal(head.to_target_ids(torch.arange(128)), torch.nonzero(w["t2d"]).flatten())
    assert target.model.aux_hidden_state_layers == EAGLE3_AUX_LAYERS
    # One layer's keys and values: 2 x block of 4 x 2 KV heads x 16 x 4 bytes.
    assert proposer.kv_cache_block_bytes() == 2 * BLOCK_SIZE * 2 * 16 * 4


def test_the_heads_forward_matches_the_reference(eagle3_head, tiny_checkpoints):
    """Twelve positions in two chunks through the paged cache (the second chunk attends to the
    first's cached keys and values) against the reference over the whole sequence."""
    target, proposer = load_eagle3(eagle3_head, tiny_checkpoints["llama"])
    head, reference = proposer.drafter, Eagle3Reference(eagle3_head, target.model.embed_tokens.weight)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(12, 192, generator=gen)
    tokens = torch.randint(0, 384, (12,), generator=gen)
    proposer.initialize_kv_cache(8)
    tables = allocate_block_tables([12], BLOCK_SIZE, 8, gen)
    outputs = []
    with torch.inference_mode():
        for start, end in [(0, 7), (7, 12)]:
            md = make_attention_metadata([end - start], [end], tables, BLOCK_SIZE)
            with set_forward_context(md):
                g = head.combine_hidden_states(features[start:end])
                outputs.append(head(tokens[start:end], torch.arange(start, end), g))
        out = torch.cat(outputs)
        expected = reference(reference.features(features), tokens, torch.arange(12))
        torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)
        torch.testing.assert_close(head.compute_logits(out), reference.logits(expected), rtol=0, atol=ATOL)


@pytest.mark.parametrize("lookahead", [0, K - 1], ids=["step-slots-only", "lookahead-slots"])
def test_drafts_follow_the_references_greedy_chain(eagle3_head, tiny_checkpoints, lookahead):
    """Requests A (a prompt in two chunks), B (decoding with its drafts verified greedily, then
    all accepted) and C (a prefix-cache hit on A's first two blocks), in shared steps: after every
    step each sampling request's drafts are the reference chain on its tokens, cut where the
    chain would write past the blocks the request owns (all k with the lookahead slots)."""
    path = tiny_checkpoints["llama"]
    target, proposer = load_eagle3(eagle3_head, path)
    reference = Eagle3Reference(eagle3_head, target.model.embed_tokens.weight)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    steps = DraftSteps(target, proposer, block_size=BLOCK_SIZE, lookahead=lookahead)
    a, b = random_tokens(11, seed=2), random_tokens(6, seed=3)
    steps.add(2, a)
    steps.add(0, b)
    drafts = _check(steps, reference, hf, steps.step(prefill={2: 7, 0: 6}))  # A's first chunk, B's prompt
    assert list(drafts) == [0]
    drafts = _check(steps, reference, hf, steps.step(prefill={2: 4}, verify={0: drafts[0]}))
    steps.add(1, a[:9] + random_tokens(3, seed=4), shared_from=2, num_cached_blocks=2)
    accept = {2: 1, 0: len(drafts[0])}
    drafts = _check(steps, reference, hf, steps.step(prefill={1: 4}, verify=drafts, accept=accept))
    assert sorted(drafts) == [0, 1, 2]
    drafts = _check(steps, reference, hf, steps.step(verify=drafts))
    if lookahead:
        assert all(len(d) == K for d in drafts.values())


def _check(steps: DraftSteps, reference, hf, drafts: dict[int, list[int]]) -> dict[int, list[int]]:
    """Each request's drafts are the reference chain on its tokens, as many as its blocks allow."""
    for slot, proposed in drafts.items():
        tokens = steps.tokens(slot)
        owned_past_last = int(steps.num_blocks[slot]) * BLOCK_SIZE - (len(tokens) - 2)
        assert len(proposed) == min(K, owned_past_last), (slot, tokens)
        expected = reference_drafts(reference, hf_features(hf, tokens[:-1]), tokens, K)
        assert proposed == expected[: len(proposed)], (slot, tokens)
    return drafts


def test_an_update_of_the_targets_embedding_reaches_the_tied_head(eagle3_head, tiny_checkpoints):
    """The head embeds with the target's own module: an RL update of the target's embedding is
    the head's too (its drafts follow the reference on the new embedding); the head's own
    tensors update by their names, and the target's names are not the head's."""
    path = tiny_checkpoints["llama"]
    target, proposer = load_eagle3(eagle3_head, path)
    new_embedding = torch.randn(384, 64, generator=torch.Generator().manual_seed(5)) * 0.2
    target.load_weights([("model.embed_tokens.weight", new_embedding)])
    assert proposer.load_weights([("model.embed_tokens.weight", new_embedding)]) == set()
    assert torch.equal(proposer.drafter.embed_tokens.weight, new_embedding)
    new_fc = torch.randn(64, 192, generator=torch.Generator().manual_seed(6)) * 0.2
    assert proposer.load_weights([("fc.weight", new_fc)]) == {"fc.weight"}

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.model.embed_tokens.weight.data.copy_(new_embedding)
    reference = Eagle3Reference(eagle3_head, new_embedding)
    reference.w["fc.weight"] = new_fc
    steps = DraftSteps(target, proposer, block_size=BLOCK_SIZE, lookahead=K - 1)
    steps.add(0, random_tokens(7, seed=7))
    drafts = steps.step(prefill={0: 7})
    tokens = steps.tokens(0)
    assert drafts[0] == reference_drafts(reference, hf_features(hf, tokens[:-1]), tokens, K)


def test_drafting_needs_the_targets_states(eagle3_head, tiny_checkpoints):
    _, proposer = load_eagle3(eagle3_head, tiny_checkpoints["llama"])
    inputs = ProposerInputs(["a"], np.array([0]), np.zeros((1, 8), dtype=np.int64), np.array([3]))
    with pytest.raises(ValueError, match="needs the target's states"):
        proposer.propose(inputs)


def test_an_eagle_head_drafts_the_references_chain(eagle_head, tiny_checkpoints):
    """A plain EAGLE head: its own embedding, the target's LM head and final hidden states."""
    path = tiny_checkpoints["llama"]
    target = load_shoal(path)
    proposer = make_proposer(
        SpeculativeConfig(method="eagle", num_speculative_tokens=K, model=str(eagle_head)), block_size=BLOCK_SIZE
    )
    proposer.load_model(target)
    head = proposer.drafter
    assert head.lm_head is target.lm_head and head.embed_tokens is not target.model.embed_tokens
    assert head.fc.bias is not None and target.model.aux_hidden_state_layers == ()
    reference = EagleReference(eagle_head, path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    steps = DraftSteps(target, proposer, block_size=BLOCK_SIZE, lookahead=K - 1)
    steps.add(0, random_tokens(6, seed=10))
    steps.add(1, random_tokens(9, seed=11))
    drafts = steps.step(prefill={0: 6, 1: 5})
    drafts = steps.step(prefill={1: 4}, verify=drafts, accept={0: 2})
    for slot, proposed in drafts.items():
        tokens = steps.tokens(slot)
        with torch.no_grad():
            features = hf.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        assert proposed == reference_drafts(reference, features, tokens, K), slot
