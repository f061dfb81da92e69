"""The trainer's side of RL (see docs/rl.md): `WeightSender` broadcasts a model's weights, in
buckets, to the engines that joined its weight-update group; `routing_masks` turns the routed
experts of rollouts into the masks a trainer replays."""

from shoal.rl.routing_masks import decode_routed_experts, routing_masks
from shoal.rl.sender import WeightSender
from shoal.rl_verbs import DEFAULT_BUCKET_BYTES

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightSender", "decode_routed_experts", "routing_masks"]
