"""A worker extension for the tests (`worker_extension_cls="tests.workers.weight_probe:WeightProbe"`):
one method reads a parameter's norm, one scales it, both through the worker's model."""

from __future__ import annotations

import torch


class WeightProbe:
    runner: object  # the worker's model runner (this class is mixed into `Worker`)

    def parameter_norm_squared(self, name: str) -> float:
        """This rank's shard of `name`: the sum of its squares (the ranks' sum is the full one's)."""
        return float(self._parameter(name).double().pow(2).sum())

    def scale_parameter(self, name: str, factor: float) -> None:
        with torch.no_grad():
            self._parameter(name).mul_(factor)

    def _parameter(self, name: str) -> torch.Tensor:
        return dict(self.runner.model.named_parameters())[name]  # type: ignore[attr-defined]


class Clashing:
    """Would replace the worker's own `load_model`: refused."""

    def load_model(self) -> None:
        pass
