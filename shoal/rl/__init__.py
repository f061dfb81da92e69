"""The trainer's side of RL weight updates (see docs/rl.md): `WeightSender` broadcasts a
model's weights, in buckets, to the engines that joined its weight-update group."""

from shoal.rl.sender import WeightSender
from shoal.rl_verbs import DEFAULT_BUCKET_BYTES

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightSender"]
