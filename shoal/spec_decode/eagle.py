"""Proposers that draft with a head reading the target's hidden states: `EagleProposer` (an EAGLE
head, shoal/models/llama_eagle.py: the target's final hidden states) and `Eagle3Proposer` (an
EAGLE-3 head, shoal/models/llama_eagle3.py: three target layers' features); the MTP proposer
(shoal/spec_decode/mtp.py) drives DeepSeek-V3's next-token module the same way.

After each step `propose` runs the drafter in two parts:

1. **The step pass**, over every row the target just ran (prefill chunks, decodes, verified
   drafts), each paired with the token after its position, under the target's own attention
   metadata. The drafter's KV cache (one layer) has the target's block size and block count and
   is addressed by the target's block tables and slot mapping, so this writes an entry for every
   position the target computed, and prefix caching and preemption cover it with no bookkeeping
   of its own. Rows past a request's accepted tokens (rejected drafts) are run too: their entries
   are overwritten when those positions are next written, as the target's are. The pass runs on
   every step that ran the target, whether or not any request drafts.
2. **The chain**, for each drafting request whose tokens end at position P (the token just
   emitted): the step row at P - 1 (the last accepted token, paired with the emitted one) gives
   draft 1, for position P + 1, by argmax; each further draft j + 1 is a one-token forward at
   position P + j - 1 that reads the drafter's previous output as its hidden state and draft j as
   its token. These forwards write the drafter's KV at positions P .. P + k - 2, which the next
   step pass overwrites with the target's states.

Drafts are argmax point masses (`Drafts.probs` is None), which the rejection sampler verifies as
such: the output is the target's whatever the drafter proposes.

The chain writes up to k - 1 positions past the request's tokens, into blocks the request must own:
a chain stops before a position in a block not yet allocated (`ProposerInputs.num_blocks`), so
with the scheduler allocating only the step's tokens a request near the end of its last block
drafts fewer than k; the KV manager can reserve the k - 1 lookahead slots so that it never does.

A prefix-cache hit reuses the drafter's entries with the target's. The entry at a cached block's
last position was computed with the token after it in the request that filled the block; another
request that shares the block but not the next token reads that entry as it is. Only its drafts
can differ from what a cold start would propose, never its output.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from shoal.forward_context import AttentionMetadata, set_forward_context
from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.proposer import Drafts, Proposer, ProposerInputs, TargetStates

logger = logging.getLogger(__name__)


class Drafter(Protocol):
    """What the proposer asks of an EAGLE head or an MTP module."""

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's hidden states of the step's rows -> the drafter's h [num_tokens, hidden]."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """(the token after each position, positions, h) -> the drafter's output [num_tokens, hidden]."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list[Any]: ...

    def load_weights(self, weights: Any) -> set[str]: ...


@dataclass(frozen=True)
class _Chains:
    """The drafting requests' chains, one per request that drafts this step."""

    reqs: np.ndarray  # [num_chains] indices into ProposerInputs.req_ids
    rows: np.ndarray  # [num_chains] the step row whose output gives draft 1
    last_positions: np.ndarray  # [num_chains] that row's position (P - 1)
    num_drafts: np.ndarray  # [num_chains] >= 1
    slots: np.ndarray  # [num_chains] input-batch rows


class EagleProposer(Proposer):
    """An EAGLE head (`method: "eagle"`, `model`: the head's folder) on a Llama-family target; the
    drafting of every head-like drafter (EAGLE-3, MTP: subclasses that build their own)."""

    method = "eagle"
    uses_target_hidden_states = True

    def __init__(self, config: SpeculativeConfig, *, block_size: int = 16) -> None:
        super().__init__(config)
        self.block_size = block_size
        self._drafter: Drafter | None = None
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.kv_caches: list[torch.Tensor] = []

    @property
    def drafter(self) -> Drafter:
        if self._drafter is None:
            raise RuntimeError(f"the {self.method} drafter is not loaded (load_model)")
        return self._drafter

    # ---- model and KV cache ----------------------------------------------------------------

    def load_model(self, target_model: Any) -> None:
        """Build and load the drafter on the target's device, in its dtype, tied to its
        embedding and LM head where the checkpoint ties them."""
        embedding = target_model.model.embed_tokens.weight
        self.dtype, self.device = embedding.dtype, embedding.device
        with torch.no_grad():
            self._drafter = self.build_drafter(target_model)

    def build_drafter(self, target_model: Any) -> Drafter:
        """The EAGLE head of `config.model`, reading the target's final hidden states."""
        from shoal.models.llama_eagle import EagleLlamaForCausalLM

        folder, head_config, names = self._head_checkpoint()
        with build_context(self.dtype, self.device):
            head = EagleLlamaForCausalLM(
                head_config,
                has_embedding="embed_tokens.weight" in names,
                fc_bias="fc.bias" in names,
                max_position=_max_position(head_config, target_model.config),
            )
        load_checkpoint(head, folder)
        head.tie_to_target(target_model)
        return head.eval()

    def _head_checkpoint(self) -> tuple[str, Any, set[str]]:
        """The head's folder, config and tensor names."""
        from shoal.config import load_hf_config

        folder = self.config.model
        assert folder is not None, f"SpeculativeConfig requires a head folder for {self.method}"
        return folder, load_hf_config(folder), tensor_names(folder)

    def kv_cache_block_bytes(self) -> int:
        return sum(
            layer.kv_cache_spec.block_bytes(self.block_size, self.dtype) for layer in self.drafter.attention_layers()
        )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = []
        for layer in self.drafter.attention_layers():
            cache = layer.kv_cache_spec.allocate(num_blocks, self.block_size, self.dtype, self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    def load_weights(self, weights: Any) -> set[str]:
        with torch.no_grad():
            return self.drafter.load_weights(weights)

    # ---- drafting ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, inputs: ProposerInputs) -> Drafts:
        target = inputs.target
        if target is None or target.slots is None:
            raise ValueError(
                f"the {self.method} proposer needs the target's states with their rows (TargetStates.slots)"
            )
        hidden_states = self._step_pass(inputs, target)  # [num_tokens, hidden]
        chains = self._chains(inputs, target)
        token_ids = np.full((len(inputs.req_ids), self.num_speculative_tokens), -1, dtype=np.int64)
        num_draft_tokens = np.zeros(len(inputs.req_ids), dtype=np.int64)
        if len(chains.reqs):
            token_ids[chains.reqs] = self._draft(chains, hidden_states, inputs)
            num_draft_tokens[chains.reqs] = chains.num_drafts
        return Drafts(token_ids, num_draft_tokens)

    def _step_pass(self, inputs: ProposerInputs, target: TargetStates) -> torch.Tensor:
        """The drafter over every row of the step, each row with the token after its position."""
        md = target.attn_metadata
        starts = np.asarray(target.query_start_loc, dtype=np.int64)
        query_lens = np.diff(starts)
        first_positions = md.seq_lens_cpu.numpy().astype(np.int64) - query_lens  # [num_step_reqs]
        positions = np.repeat(first_positions - starts[:-1], query_lens) + np.arange(md.num_tokens)  # [num_tokens]
        rows = np.repeat(np.asarray(target.slots), query_lens)
        # Past a request's tokens (rows of rejected drafts) the entry read is stale: any token serves.
        next_positions = np.minimum(positions + 1, inputs.token_ids.shape[1] - 1)
        next_ids = self._to_device(inputs.token_ids[rows, next_positions])
        drafter = self.drafter
        with set_forward_context(md):
            hidden_states = drafter.combine_hidden_states(target.hidden_states[: md.num_tokens])
            return drafter(next_ids, target.positions[: md.num_tokens], hidden_states)

    def _chains(self, inputs: ProposerInputs, target: TargetStates) -> _Chains:
        """Which requests draft and how many: those that ran this step up to their last accepted
        token, at most k, each request's cap, what fits in max_model_len (token_ids' width) and
        what fits in the blocks the request owns."""
        if inputs.block_table is None or inputs.num_blocks is None:
            raise ValueError(
                f"the {self.method} proposer needs the input batch's block table (ProposerInputs.block_table)"
            )
        assert target.slots is not None
        md = target.attn_metadata
        starts = np.asarray(target.query_start_loc, dtype=np.int64)
        seq_lens = md.seq_lens_cpu.numpy().astype(np.int64)
        first_positions = seq_lens - np.diff(starts)
        step_index = np.full(inputs.token_ids.shape[0], -1, dtype=np.int64)  # input-batch row -> step request
        step_index[np.asarray(target.slots)] = np.arange(len(target.slots))
        slots = np.asarray(inputs.slots, dtype=np.int64)
        index = step_index[slots]
        safe_index = np.maximum(index, 0)
        last_positions = np.asarray(inputs.num_tokens, dtype=np.int64) - 2  # pairs with the emitted token
        in_step = (
            (index >= 0) & (last_positions >= first_positions[safe_index]) & (last_positions < seq_lens[safe_index])
        )
        cap = np.full(len(slots), self.num_speculative_tokens, dtype=np.int64)
        if inputs.max_num_drafts is not None:
            cap = np.minimum(cap, inputs.max_num_drafts)
        cap = np.minimum(cap, inputs.token_ids.shape[1] - 2 - last_positions)  # drafts up to position max_model_len - 1
        cap = np.minimum(cap, inputs.num_blocks[slots] * self.block_size - last_positions)  # chain writes owned slots
        num_drafts = np.where(in_step, np.maximum(cap, 0), 0)
        reqs = np.flatnonzero(num_drafts > 0)
        index, last = index[reqs], last_positions[reqs]
        return _Chains(reqs, starts[index] + last - first_positions[index], last, num_drafts[reqs], slots[reqs])

    def _draft(self, chains: _Chains, hidden_states: torch.Tensor, inputs: ProposerInputs) -> np.ndarray:
        """The chains' drafts [num_chains, k] (-1 after each chain's count), by argmax."""
        assert inputs.block_table is not None
        drafter = self.drafter
        drafts = torch.full((len(chains.reqs), self.num_speculative_tokens), -1, dtype=torch.int64, device=self.device)
        live = np.arange(len(chains.reqs))  # the chains still drafting
        hidden = hidden_states[self._to_device(chains.rows)]  # [num_live, hidden]
        for j in range(self.num_speculative_tokens):
            token_ids = drafter.to_target_ids(drafter.compute_logits(hidden).argmax(dim=-1))  # [num_live]
            drafts[self._to_device(live), j] = token_ids
            keep = chains.num_drafts[live] > j + 1
            if not keep.any():
                break
            if not keep.all():
                kept = self._to_device(np.flatnonzero(keep))
                live, hidden, token_ids = live[keep], hidden[kept], token_ids[kept]
            positions = chains.last_positions[live] + j + 1
            md = self._decode_metadata(positions, chains.slots[live], inputs.block_table)
            with set_forward_context(md):
                hidden = drafter(token_ids, self._to_device(positions), hidden)
        return drafts.cpu().numpy()

    def _decode_metadata(self, positions: np.ndarray, slots: np.ndarray, block_table: np.ndarray) -> AttentionMetadata:
        """One new token a request at `positions`, in the blocks of input-batch rows `slots`."""
        num_reqs = len(positions)
        seq_lens = positions + 1
        max_seq_len = int(seq_lens.max())
        tables = block_table[slots, : -(-max_seq_len // self.block_size)]  # [num_reqs, blocks needed]
        block_ids = tables[np.arange(num_reqs), positions // self.block_size].astype(np.int64)
        query_start_loc = np.arange(num_reqs + 1, dtype=np.int32)
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_tokens=num_reqs,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(tables.astype(np.int32)),
            slot_mapping=self._to_device(block_ids * self.block_size + positions % self.block_size),
            query_start_loc_cpu=torch.from_numpy(query_start_loc),
            seq_lens_cpu=torch.from_numpy(seq_lens.astype(np.int32)),
            is_decode_only=True,
            decode_order=self._to_device(np.argsort(-seq_lens, kind="stable").astype(np.int32)),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)


class Eagle3Proposer(EagleProposer):
    """An EAGLE-3 head (`method: "eagle3"`), which fuses three target layers' features."""

    method = "eagle3"

    def build_drafter(self, target_model: Any) -> Drafter:
        """The EAGLE-3 head of `config.model`; makes the target return the features it fuses."""
        from shoal.models.llama_eagle3 import Eagle3LlamaForCausalLM, eagle3_aux_layers

        folder, head_config, names = self._head_checkpoint()
        target_config = target_model.config
        with build_context(self.dtype, self.device):
            head = Eagle3LlamaForCausalLM(
                head_config,
                has_embedding="embed_tokens.weight" in names,
                has_lm_head="lm_head.weight" in names,
                max_position=_max_position(head_config, target_config),
            )
        if head.draft_vocab_size != head.vocab_size and "d2t" not in names:
            raise ValueError(f"EAGLE-3 head {folder!r} has a draft vocabulary of its own but no d2t mapping")
        load_checkpoint(head, folder)
        head.tie_to_target(target_model)
        aux_layers = tuple(sorted(set(eagle3_aux_layers(head_config, int(target_config.num_hidden_layers)))))
        if len(aux_layers) * int(target_config.hidden_size) != head.fc.input_size:
            raise ValueError(
                f"EAGLE-3 head {folder!r} fuses {head.fc.input_size} features, but target layers {list(aux_layers)} "
                f"give {len(aux_layers)} x {target_config.hidden_size}"
            )
        if not hasattr(target_model, "set_aux_hidden_state_layers"):
            raise ValueError(f"an EAGLE-3 head needs a Llama-family target, not {type(target_model).__name__}")
        target_model.set_aux_hidden_state_layers(aux_layers)
        logger.info("EAGLE-3 head %s reads target layers %s", folder, list(aux_layers))
        return head.eval()


def _max_position(head_config: Any, target_config: Any) -> int:
    """Positions a head's rotary embedding covers: the target's context, which a published head's
    `max_position_embeddings` (2048 for the Llama-3.1-8B EAGLE-3 head) understates."""
    return max(int(head_config.max_position_embeddings), int(target_config.max_position_embeddings))


# ---- loading, shared with the MTP proposer ----------------------------------------------------


@contextmanager
def build_context(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Parameters created inside are of `dtype`, on `device` (as the target's loader builds)."""
    from shoal.models.loader import default_dtype

    with default_dtype(dtype), torch.device(device):
        yield


def tensor_names(folder: str, files: list[Path] | None = None) -> set[str]:
    """The names of a safetensors checkpoint's tensors (headers only)."""
    from safetensors import safe_open

    from shoal.models.loader import safetensors_files

    names: set[str] = set()
    for path in files if files is not None else safetensors_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def load_checkpoint(module: nn.Module, folder: str, files: list[Path] | None = None, skip: Any = None) -> None:
    """Fill `module` from the safetensors folder through its `load_weights` (every parameter must
    be loaded), then turn its weights into their run-time form (`process_weights_after_loading`).
    `files`: only these shards; `skip(name)`: tensors not to read."""
    from safetensors import safe_open

    from shoal.models.loader import check_all_loaded, process_weights_after_loading, safetensors_files

    def weights() -> Any:
        for path in files if files is not None else safetensors_files(folder):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if skip is None or not skip(name):
                        yield name, f.get_slice(name)

    with torch.no_grad():
        loaded = module.load_weights(weights())  # type: ignore[operator]
        check_all_loaded(module, loaded)
        process_weights_after_loading(module)
