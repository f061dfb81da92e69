from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tests.layers.tp_utils import fake_tp_group


def test_embedding_tp1_pads_vocab_and_looks_up():
    weight = torch.randn(100, 8)
    layer = VocabParallelEmbedding(100, 8)
    layer.weight.weight_loader(layer.weight, weight)
    assert layer.weight.shape == (128, 8)
    assert torch.count_nonzero(layer.weight[100:]) == 0
    ids = torch.tensor([0, 99, 42])
    assert torch.equal(layer(ids), weight[ids])


@pytest.mark.parametrize("vocab", [1001, 128, 7])
def test_embedding_shards_sum_to_the_full_lookup(vocab):
    """Each rank embeds only the ids it owns; the all-reduce's sum is the full lookup."""
    weight = torch.randn(vocab, 4)
    ids = torch.randint(0, vocab, (9,))
    partials = []
    for rank in range(2):
        with fake_tp_group(rank):
            layer = VocabParallelEmbedding(vocab, 4)
        layer.weight.weight_loader(layer.weight, weight)
        per_rank = layer.num_embeddings_per_partition
        assert layer.num_embeddings_padded % 128 == 0 and per_rank * 2 == layer.num_embeddings_padded
        real = weight[rank * per_rank : (rank + 1) * per_rank]
        assert torch.equal(layer.weight[: len(real)], real)
        assert torch.count_nonzero(layer.weight[len(real) :]) == 0
        owned = (ids >= layer.vocab_start_index) & (ids < layer.vocab_end_index)
        local = (ids - layer.vocab_start_index) * owned
        partials.append(F.embedding(local, layer.weight) * owned[:, None])
    assert torch.equal(partials[0] + partials[1], weight[ids])


def test_lm_head_logits_trim_padding_and_tie():
    weight, hidden = torch.randn(70, 8), torch.randn(3, 8)
    embedding = VocabParallelEmbedding(70, 8)
    head = ParallelLMHead(70, 8)
    head.tie_weights(embedding)
    embedding.weight.weight_loader(embedding.weight, weight)
    logits = head.compute_logits(hidden)
    assert logits.shape == (3, 70)
    torch.testing.assert_close(logits, hidden @ weight.T)
