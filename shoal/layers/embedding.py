"""Token embedding and language-model head split by vocabulary across the tensor-parallel group
(Shoeybi et al., 2019, "Megatron-LM", section 3: the input embedding is parallelized along the
vocabulary dimension).

The vocabulary is padded up to a multiple of `padding_size * tp_size`, so every rank holds the
same number of rows whatever the vocabulary size; rank r holds token ids
`[r * rows_per_rank, (r + 1) * rows_per_rank)`, and the rows past the real vocabulary are zero.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import get_tp_group
from shoal.layers.weight_utils import LoadedWeight, narrow_weight, new_parameter, weight_shape

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup where each rank holds a contiguous slice of the (padded) vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_size: int = DEFAULT_VOCAB_PADDING_SIZE):
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = new_parameter(self.num_embeddings_per_partition, embedding_dim, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        """Copy rows [vocab_start_index, min(vocab_end_index, vocab)) and zero the padding rows."""
        vocab_size = weight_shape(loaded)[0]
        if vocab_size != self.num_embeddings:
            raise ValueError(f"embedding has {vocab_size} rows, the config says vocab_size={self.num_embeddings}")
        num_real_rows = max(0, min(self.vocab_end_index, vocab_size) - self.vocab_start_index)
        param.data[num_real_rows:].zero_()
        if num_real_rows > 0:
            shard = narrow_weight(loaded, 0, self.vocab_start_index, num_real_rows)
            param.data[:num_real_rows].copy_(shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)  # [num_tokens, embedding_dim]
        # Look up the ids this rank owns, zero the rest, and sum the ranks' partial results.
        owned = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * owned
        embeddings = F.embedding(local_ids, self.weight) * owned.unsqueeze(-1)  # [num_tokens, embedding_dim]
        return get_tp_group().all_reduce(embeddings)

    def extra_repr(self) -> str:
        return (
            f"vocab={self.num_embeddings} (padded {self.num_embeddings_padded}), "
            f"per_rank={self.num_embeddings_per_partition}, dim={self.embedding_dim}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits, sharded like the embedding so that tied
    weights (`tie_word_embeddings`) can share one parameter."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
    ):
        super().__init__(num_embeddings, embedding_dim, padding_size)
        self.bias = new_parameter(self.num_embeddings_per_partition, weight_loader=self.weight_loader) if bias else None

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [num_tokens, hidden] -> logits [num_tokens, vocab_size] (full vocabulary)."""
        logits = F.linear(hidden_states, self.weight, self.bias)  # [num_tokens, vocab_per_rank]
        logits = get_tp_group().all_gather(logits, dim=-1)  # [num_tokens, vocab_padded]
        return logits[..., : self.num_embeddings]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not called; use compute_logits(hidden_states)")
