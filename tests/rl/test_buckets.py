"""Weight buckets: the sender's and the receiver's plans agree, packing then unpacking gives the
tensors back (any dtype, aligned offsets), and a CPU bucket survives the msgpack utility path."""

from __future__ import annotations

import msgspec
import pytest
import torch

from shoal.rl.buckets import ALIGN_BYTES, TensorMeta, as_metas, bucket_offsets, pack, plan_buckets, unpack
from shoal.rl.tensor_transfer import cpu_bucket, open_bucket, plan_tensor_buckets


def test_plan_buckets_is_greedy_in_order_and_a_large_tensor_goes_alone() -> None:
    metas = [TensorMeta(f"w{i}", "float32", (n,)) for i, n in enumerate([100, 100, 1000, 10])]
    buckets = plan_buckets(metas, bucket_bytes=1024)  # 100 floats take 512 aligned bytes
    assert [[m.name for m in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(metas, 0)


def test_pack_then_unpack_gives_every_tensor_back() -> None:
    tensors = [torch.randn(3, 5).to(torch.bfloat16), torch.arange(7), torch.randn(2, 2, 2)]
    names = ["a", "b", "c"]
    buffer = pack(tensors)
    metas = [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in zip(names, tensors)]
    offsets, total = bucket_offsets(metas)
    assert all(offset % ALIGN_BYTES == 0 for offset in offsets) and buffer.numel() == total
    for (name, view), expected, meta in zip(unpack(buffer, metas), tensors, metas):
        assert name == meta.name and view.dtype == expected.dtype and torch.equal(view, expected)


def test_a_cpu_bucket_crosses_msgpack() -> None:
    named = [("x", torch.randn(4, 4)), ("y", torch.randn(8).to(torch.float16))]
    [bucket] = [cpu_bucket(b) for b in plan_tensor_buckets(named, 1 << 20)]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(bucket))
    assert [(n, torch.equal(t, dict(named)[n])) for n, t in open_bucket(decoded)] == [("x", True), ("y", True)]


def test_metadata_lists_are_checked() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        as_metas(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        as_metas(["a"], ["float33"], [[1]])
    assert as_metas(["a"], ["torch.bfloat16"], [[2, 3]]) == [TensorMeta("a", "bfloat16", (2, 3))]
