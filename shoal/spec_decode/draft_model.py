"""`DraftModelProposer` (`method: "draft_model"`): a second, smaller model of the target's
vocabulary, loaded in the same worker by shoal's own loader, drafts by argmax.

Its KV cache has the target's block size and block count and is addressed by the target's block
tables (`kv_cache_block_bytes` joins the target's per block), so prefix caching, preemption and
freeing cover it with no bookkeeping of its own. After each step `propose`:

1. **The step pass**: the draft model runs the step's own rows (the target's input ids and
   positions, under the target's attention metadata), writing its KV at every position the target
   wrote. Rows of rejected drafts are overwritten when those positions are next written. It runs
   on every step that ran the target, drafting or not, so that its cache has no holes.
2. **The chain**: for each drafting request whose tokens end at position P (the token just
   emitted, which the target has not computed yet), a one-token forward of that token at P gives
   draft 1 by argmax, then draft j at P + j gives draft j + 1. These write the draft's KV at
   P .. P + n - 1, in blocks the request owns (the scheduler's lookahead slots): a chain never
   writes past them.

Its weights take RL updates by its own checkpoint names (`load_weights`), and the KV cache entries
at a position depend only on the tokens up to it, so a prefix-cache hit reuses them exactly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shoal.forward_context import set_forward_context
from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.eagle import EagleProposer, _Chains
from shoal.spec_decode.proposer import Drafts, ProposerInputs, TargetStates

if TYPE_CHECKING:
    from shoal.config import ModelConfig


class DraftModelProposer(EagleProposer):
    method = "draft_model"
    uses_target_hidden_states = False

    def __init__(self, config: SpeculativeConfig, *, block_size: int = 16, model_config: ModelConfig) -> None:
        super().__init__(config, block_size=block_size)
        self.target_model_config = model_config

    def build_drafter(self, target_model: Any) -> Any:
        """The draft model in the target's dtype on its device (one rank: it is not sharded)."""
        from shoal.config import ParallelConfig, _architecture, load_hf_config
        from shoal.models.loader import get_model

        folder = self.config.model
        assert folder is not None
        hf_config = load_hf_config(folder)
        draft_config = dataclasses.replace(
            self.target_model_config,
            model=folder,
            tokenizer=folder,
            hf_config=hf_config,
            architecture=_architecture(hf_config),
            vocab_size=int(hf_config.vocab_size),
            quantization=None,
        )
        return get_model(draft_config, self.device, ParallelConfig()).eval()

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> Drafts:
        target = inputs.target
        if target is None or target.slots is None:
            raise ValueError("the draft_model proposer needs the target's step (TargetStates with slots)")
        md = target.attn_metadata
        model: Any = self.drafter  # a causal LM, not a head: (input ids, positions) -> hidden states
        with set_forward_context(md):  # the step pass
            model(target.input_ids[: md.num_tokens], target.positions[: md.num_tokens])
        chains = self._draft_chains(inputs, target)
        token_ids = np.full((len(inputs.req_ids), self.num_speculative_tokens), -1, dtype=np.int64)
        num_draft_tokens = np.zeros(len(inputs.req_ids), dtype=np.int64)
        if len(chains.reqs):
            token_ids[chains.reqs] = self._draft_by_chain(chains, inputs)
            num_draft_tokens[chains.reqs] = chains.num_drafts
        return Drafts(token_ids, num_draft_tokens)

    def _draft_chains(self, inputs: ProposerInputs, target: TargetStates) -> _Chains:
        """EAGLE's chains (requests that ran up to their last accepted token, capped by k, the
        request's cap and max_model_len), one draft fewer where the emitted token's own forward
        would leave the blocks the request owns."""
        chains = self._chains(inputs, target)
        assert inputs.num_blocks is not None
        owned = inputs.num_blocks[chains.slots] * self.block_size - (chains.last_positions + 1)
        num_drafts = np.minimum(chains.num_drafts, owned)
        keep = num_drafts > 0
        return _Chains(
            chains.reqs[keep], chains.rows[keep], chains.last_positions[keep], num_drafts[keep], chains.slots[keep]
        )

    def _draft_by_chain(self, chains: _Chains, inputs: ProposerInputs) -> np.ndarray:
        """[num_chains, k] drafts (-1 after each chain's count): the emitted token at P, then each
        draft in turn, one token a forward."""
        assert inputs.block_table is not None
        drafter: Any = self.drafter
        drafts = torch.full((len(chains.reqs), self.num_speculative_tokens), -1, dtype=torch.int64, device=self.device)
        live = np.arange(len(chains.reqs))
        token_ids = self._to_device(inputs.token_ids[chains.slots, chains.last_positions + 1])  # the emitted tokens
        for j in range(self.num_speculative_tokens):
            positions = chains.last_positions[live] + 1 + j
            md = self._decode_metadata(positions, chains.slots[live], inputs.block_table)
            with set_forward_context(md):
                hidden = drafter(token_ids, self._to_device(positions))
            token_ids = drafter.compute_logits(hidden).argmax(dim=-1)  # [num_live]
            drafts[self._to_device(live), j] = token_ids
            keep = chains.num_drafts[live] > j + 1
            if not keep.any():
                break
            if not keep.all():
                live, token_ids = live[keep], token_ids[self._to_device(np.flatnonzero(keep))]
        return drafts.cpu().numpy()

    def load_weights(self, weights: Any) -> set[str]:
        """An RL update of the draft model, by its own checkpoint's names."""
        with torch.no_grad():
            return self.drafter.load_weights(weights)
