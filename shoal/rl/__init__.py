"""The trainer's side of RL weight updates (see docs/rl.md): `WeightSender` broadcasts a
model's weights, in buckets, to the engines that joined its weight-update group."""

from shoal.rl.buckets import DEFAULT_BUCKET_BYTES
from shoal.rl.sender import WeightSender

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightSender"]
