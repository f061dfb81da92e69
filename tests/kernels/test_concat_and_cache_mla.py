"""`concat_and_cache_mla_ref`: each token's [kv_c, k_pe] at its slot, padding written nowhere
(the Triton kernel is compared with it in test_mla_decode.py)."""

from __future__ import annotations

import torch

from shoal.kernels.concat_and_cache_mla import concat_and_cache_mla


def test_each_latent_lands_at_its_slot():
    kv_c, k_pe = torch.randn(4, 6), torch.randn(4, 2)
    cache = torch.zeros(1, 3, 2, 1, 8)  # 3 blocks of 2 positions
    concat_and_cache_mla(kv_c, k_pe, cache, torch.tensor([5, -1, 0, 3]))
    slots = cache.view(6, 8)
    for token, slot in ((0, 5), (2, 0), (3, 3)):
        assert torch.equal(slots[slot], torch.cat((kv_c[token], k_pe[token])))
    assert not slots[[1, 2, 4]].any()  # padding (token 1) went nowhere
