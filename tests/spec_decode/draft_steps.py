"""`DraftSteps`: a target model and a model-based proposer run step by step on CPU, as the model
runner will run them: each step computes some requests' prompt chunks and verifies other
requests' drafts in one flat batch through the paged KV cache, emits tokens, writes them into the
input batch's token rows, and asks the proposer for the next drafts with the step's
`TargetStates`.

Verification is greedy, or forced to accept a given number of drafts (the emitted tokens then
follow the drafts, then the target's argmax), so that tests can walk any path through partial
acceptance; either way the token rows are what the requests' sequences are, and a reference
computed on those sequences says what the drafts must be.
"""

from __future__ import annotations

import numpy as np
import torch

from shoal.forward_context import set_forward_context
from shoal.spec_decode.draft_layout import DraftLayout
from shoal.spec_decode.proposer import Proposer, ProposerInputs, TargetStates
from tests.kernels.metadata_utils import make_attention_metadata


class DraftSteps:
    def __init__(
        self,
        target: torch.nn.Module,
        proposer: Proposer,
        block_size: int = 4,
        num_blocks: int = 64,
        max_num_reqs: int = 4,
        max_model_len: int = 64,
        lookahead: int = 0,
        seed: int = 0,
    ):
        """`lookahead`: slots allocated past each step's tokens (0: only the step's, so that a
        chain near the end of a request's last block stops short)."""
        self.target, self.proposer, self.block_size = target, proposer, block_size
        self.lookahead = lookahead
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_model_len // block_size), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        dtype = next(target.parameters()).dtype
        for layer in target.attention_layers():
            layer.kv_cache = layer.kv_cache_spec.allocate(num_blocks, block_size, dtype, torch.device("cpu"))
        proposer.initialize_kv_cache(num_blocks)

    def add(self, slot: int, prompt: list[int], shared_from: int | None = None, num_cached_blocks: int = 0) -> None:
        """A new request in input-batch row `slot`; with `shared_from`, its first
        `num_cached_blocks` blocks are that request's (a prefix-cache hit: computed already)."""
        self.token_ids[slot, : len(prompt)] = prompt
        self.num_tokens[slot] = len(prompt)
        self.num_blocks[slot] = 0
        if shared_from is not None:
            self.block_table[slot, :num_cached_blocks] = self.block_table[shared_from, :num_cached_blocks]
            self.num_blocks[slot] = num_cached_blocks
        self.num_computed[slot] = num_cached_blocks * self.block_size

    def tokens(self, slot: int) -> list[int]:
        return self.token_ids[slot, : self.num_tokens[slot]].tolist()

    def step(
        self,
        prefill: dict[int, int] | None = None,
        verify: dict[int, list[int]] | None = None,
        accept: dict[int, int] | None = None,
    ) -> dict[int, list[int]]:
        """One step: `prefill[slot]` prompt tokens of each request in prefill; each request in
        `verify` runs its last token and its drafts (`accept[slot]`: accept that many drafts
        whatever the target says; else greedy). Returns the proposer's drafts by slot."""
        prefill, verify, accept = prefill or {}, verify or {}, accept or {}
        slots, inputs, query_lens, num_drafts = [], [], [], []
        for slot, n in prefill.items():
            start = int(self.num_computed[slot])
            slots.append(slot)
            inputs.append(self.token_ids[slot, start : start + n].tolist())
            num_drafts.append(0)
        for slot, drafts in verify.items():
            slots.append(slot)
            inputs.append([int(self.token_ids[slot, self.num_tokens[slot] - 1]), *drafts])
            num_drafts.append(len(drafts))
        query_lens = [len(x) for x in inputs]
        seq_lens = [int(self.num_computed[s]) + n for s, n in zip(slots, query_lens)]
        for slot, seq_len in zip(slots, seq_lens):
            self._allocate(slot, seq_len + self.lookahead)
        md = make_attention_metadata(
            query_lens, seq_lens, [self.block_table[s, : self.num_blocks[s]].tolist() for s in slots], self.block_size
        )
        input_ids = torch.tensor([t for x in inputs for t in x])
        positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
        with set_forward_context(md), torch.inference_mode():
            out = self.target(input_ids, positions)
            hidden, states = out if isinstance(out, tuple) else (out, out)
            logits = self.target.compute_logits(hidden)
        query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])

        sampling = [i for i, s in enumerate(slots) if seq_lens[i] >= self.num_tokens[s]]
        emitted = [self._emit(slots[i], logits[query_start_loc[i] : query_start_loc[i + 1]], num_drafts[i], inputs[i],
                              accept.get(slots[i])) for i in sampling]  # fmt: skip
        for i, s in enumerate(slots):
            if i not in sampling:
                self.num_computed[s] = seq_lens[i]
        k = self.proposer.num_speculative_tokens
        emitted_ids = torch.full((len(sampling), k + 1), -1, dtype=torch.int64)
        for row, tokens in enumerate(emitted):
            emitted_ids[row, : len(tokens)] = torch.tensor(tokens)
        states = TargetStates(
            hidden_states=states,
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            attn_metadata=md,
            layout=DraftLayout.of([num_drafts[i] for i in sampling]),
            emitted_token_ids=emitted_ids,
            num_emitted=torch.tensor([len(t) for t in emitted]),
            slots=np.array(slots),
        )
        drafting = np.array([slots[i] for i in sampling], dtype=np.int64)
        proposed = self.proposer.propose(
            ProposerInputs(
                req_ids=[str(s) for s in drafting],
                slots=drafting,
                token_ids=self.token_ids,
                num_tokens=self.num_tokens[drafting],
                target=states,
                block_table=self.block_table,
                num_blocks=self.num_blocks,
            )
        )
        return dict(zip(drafting.tolist(), proposed.as_lists()))

    def _emit(
        self, slot: int, logits: torch.Tensor, num_drafts: int, inputs: list[int], forced: int | None
    ) -> list[int]:
        """Accept drafts, emit them and one token of the target's; write them into the row."""
        rows = logits[-(num_drafts + 1) :].argmax(dim=-1).tolist()  # the target's choice after each input
        drafts = inputs[len(inputs) - num_drafts :]
        accepted = (
            forced if forced is not None else next((j for j in range(num_drafts) if drafts[j] != rows[j]), num_drafts)
        )
        tokens = [*drafts[:accepted], rows[accepted]]
        start = int(self.num_tokens[slot])
        self.token_ids[slot, start : start + len(tokens)] = tokens
        self.num_tokens[slot] += len(tokens)
        self.num_computed[slot] = self.num_tokens[slot] - 1
        return tokens

    def _allocate(self, slot: int, num_tokens: int) -> None:
        while self.num_blocks[slot] * self.block_size < num_tokens:
            self.block_table[slot, self.num_blocks[slot]] = self.free_blocks.pop()
            self.num_blocks[slot] += 1
