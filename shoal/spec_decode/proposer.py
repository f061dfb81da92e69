"""`Proposer`: what the model runner asks, after each step, for the next step's draft tokens.

After a step's tokens are emitted (the rejection sampler's accepted drafts and one more token a
request), the runner hands the proposer the requests that will run next (`ProposerInputs`) and
gets `Drafts` back: up to k token ids a request, which go to the scheduler with the step's
output. The scheduler counts them in the next step's token budget and allocates their KV slots;
the runner then scores them (`DraftLayout`, `RejectionSampler`).

Implemented: n-gram prompt lookup (`NgramProposer`, shoal/spec_decode/ngram.py), which reads only
the requests' token rows on the host; the draft model (draft_model.py), EAGLE heads (eagle.py) and
MTP (mtp.py), which the runner feeds as follows (shoal/workers/spec_decode_step.py):

- draft model (`draft_model`): a second, smaller model of the target's vocabulary, loaded in the
  same worker (`load_model`), with its own KV cache of the same block size and number of blocks
  as the target's (`kv_cache_block_bytes` joins the target's in the KV-cache budget;
  `initialize_kv_cache` allocates it), addressed by the target's block tables, so that prefix
  caching and preemption cover it with no bookkeeping of its own. Each step it runs the step's
  accepted tokens through itself (`TargetStates.input_ids`, `positions`, the step's attention
  metadata), then k - 1 more single-token forwards, sampling (or taking the argmax of) each; its
  probabilities go in `Drafts.probs` when it samples.
- EAGLE / EAGLE-3 heads (`eagle`, `eagle3`): one decoder layer that reads the target's hidden
  states (EAGLE-3: the outputs of three target layers, low, middle and high, concatenated
  [num_tokens, 3 * hidden_size] and fused by its `fc`; the runner must keep those layers'
  outputs during the forward) paired with the next token's embedding: the row of position t
  takes (hidden_t, token_{t+1}). So it needs `TargetStates.hidden_states` for every token of the
  step (prefill chunks too: its KV cache covers every position), the emitted tokens to pair with
  the last accepted row, and the target's embedding and LM head when the checkpoint ties them
  (`load_model(target_model)`); an EAGLE-3 head's smaller draft vocabulary maps onto the target's
  (`d2t`) before the drafts leave it. Its KV cache is one layer, sized and addressed as above.
- MTP (`mtp`, DeepSeek-V3): the same shape as EAGLE with the target's own next-token module
  (`enorm`/`hnorm` on the embedding and the hidden state, `eh_proj`, one decoder layer, the
  shared head), read from the target's checkpoint (the layer after the last decoder layer),
  block-fp8 like the rest; its hidden states are the target's last layer's.

RL weight updates reach a model-based proposer through its `load_weights` (names of the target's
checkpoint for MTP and tied heads, the draft model's own otherwise), and sleep / wake-up cover
its weights and KV cache (the runner's `kv_caches` hold the drafter's too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from shoal.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from shoal.forward_context import AttentionMetadata
    from shoal.spec_decode.draft_layout import DraftLayout


@dataclass
class TargetStates:
    """What a model-based proposer reads from the step the target just ran (None for n-gram).

    Rows are the step's flat tokens; request i's are query_start_loc[i]:query_start_loc[i + 1].
    Its verification rows (its last emitted token and its drafts, `layout`) are its last ones;
    of those, the first num_emitted[i] rows hold accepted tokens' states, the rest rejected
    drafts' (their KV entries are overwritten when the positions are next written)."""

    hidden_states: torch.Tensor  # [num_tokens, hidden_size] (EAGLE-3: [num_tokens, 3 * hidden_size])
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    query_start_loc: np.ndarray  # [num_reqs + 1]
    attn_metadata: AttentionMetadata  # the step's (block tables, slot mapping, sequence lengths)
    layout: DraftLayout  # the step's drafts, by sampling request
    emitted_token_ids: torch.Tensor  # [num_reqs, k + 1] the rejection sampler's, -1 padded
    num_emitted: torch.Tensor  # [num_reqs]
    # Each of the step's requests' input-batch row ([num_step_reqs], in query_start_loc's order):
    # with `ProposerInputs.token_ids` it gives the token after every row's position (the next
    # prompt token of a prefill chunk, an accepted draft, the emitted token), which an EAGLE head
    # or MTP module reads at that row.
    slots: np.ndarray | None = None


@dataclass
class ProposerInputs:
    """The requests to draft for, after a step whose emitted tokens are known.

    `token_ids` is the input batch's host array ([max_num_reqs, max_model_len], a request's
    prompt then output in its row `slots[i]`); `num_tokens[i]` counts the row's tokens including
    the ones this step emitted, which the runner writes into the row first (the scheduler's diff
    for the next step writes the same tokens there)."""

    req_ids: list[str]
    slots: np.ndarray  # [num_reqs]
    token_ids: np.ndarray  # [max_num_reqs, max_model_len]
    num_tokens: np.ndarray  # [num_reqs]
    # Each request's own cap (0: no drafts for it, e.g. its speculation is off or it is about to
    # reach max_tokens); None: k for every request.
    max_num_drafts: np.ndarray | None = None
    target: TargetStates | None = None
    # The input batch's block table ([max_num_reqs, max_blocks_per_req]) and each row's number
    # of allocated blocks ([max_num_reqs]): where a drafter that runs past the step's tokens
    # (EAGLE, MTP) writes its own drafts' KV entries.
    block_table: np.ndarray | None = None
    num_blocks: np.ndarray | None = None


@dataclass
class Drafts:
    """Up to k draft tokens a request, aligned with `ProposerInputs.req_ids`."""

    token_ids: np.ndarray  # [num_reqs, k] int64, -1 after each request's drafts
    num_draft_tokens: np.ndarray  # [num_reqs] int64
    # [num_reqs, k, vocab_size] on the device: the draft's distribution at each draft (a
    # proposer that samples its drafts); None: each draft is a point mass (n-gram lookup, or a
    # model drafting by argmax), which the rejection sampler verifies as such.
    probs: torch.Tensor | None = None

    def as_lists(self) -> list[list[int]]:
        """Each request's drafts, for the step's output to the scheduler."""
        return [row[:n] for row, n in zip(self.token_ids.tolist(), self.num_draft_tokens.tolist())]


class Proposer(ABC):
    """Drafts up to `num_speculative_tokens` tokens a request. Model-based proposers override the
    model and KV-cache hooks; their defaults are a proposer without a model."""

    method: ClassVar[str]
    uses_target_hidden_states: ClassVar[bool] = False

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens

    @abstractmethod
    def propose(self, inputs: ProposerInputs) -> Drafts: ...

    def load_model(self, target_model: Any) -> None:
        """Load the drafter's weights (sharing the target's embedding or LM head where its
        checkpoint ties them). A proposer without a model has none."""
        return

    def kv_cache_block_bytes(self) -> int:
        """Bytes of one KV block of the drafter's layers (added to the target's per block)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the drafter's KV cache: `num_blocks` blocks, the target's count and size."""
        return

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """An RL weight update of the target (its checkpoint's names): the drafter loads the
        tensors that are its own and ignores the rest. Returns the drafter's parameters loaded."""
        return set()


def make_proposer(
    config: SpeculativeConfig, *, block_size: int = 16, target_path: str | None = None, model_config: Any = None
) -> Proposer:
    """The proposer of `config.method`. `block_size`: the KV cache's (a drafter's cache has the
    target's blocks); `target_path`: the target's checkpoint folder (MTP layers live there);
    `model_config`: the target's `ModelConfig` (a draft model is built like it)."""
    if config.method == "ngram":
        from shoal.spec_decode.ngram import NgramProposer

        return NgramProposer(config)
    if config.method == "eagle":
        from shoal.spec_decode.eagle import EagleProposer

        return EagleProposer(config, block_size=block_size)
    if config.method == "eagle3":
        from shoal.spec_decode.eagle import Eagle3Proposer

        return Eagle3Proposer(config, block_size=block_size)
    if config.method == "mtp":
        from shoal.spec_decode.mtp import MtpProposer

        return MtpProposer(config, block_size=block_size, target_path=target_path)
    if config.method == "draft_model":
        from shoal.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, block_size=block_size, model_config=model_config)
    raise NotImplementedError(f"speculative decoding method {config.method!r} has no proposer yet")
