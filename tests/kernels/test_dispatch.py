from __future__ import annotations

from types import SimpleNamespace

import torch

from shoal import envs
from shoal.kernels import dispatch


def _on(device_type: str) -> SimpleNamespace:
    """Stands in for a tensor: the dispatcher reads only its device."""
    return SimpleNamespace(device=SimpleNamespace(type=device_type))


def test_cpu_tensors_use_the_reference():
    assert dispatch.compiled_op("rms_norm", torch.zeros(1)) is None
    assert not dispatch.has_op("rms_norm", torch.zeros(1))


def test_registered_kernel_is_used_on_cuda_unless_disabled(monkeypatch):
    def kernel():
        return None

    dispatch.register_kernel("shoal_test_op", kernel)
    try:
        assert dispatch.compiled_op("shoal_test_op", _on("cuda")) is kernel
        assert dispatch.compiled_op("shoal_test_op", _on("cpu")) is None
        monkeypatch.setattr(envs, "SHOAL_DISABLE_CSRC", True)
        assert dispatch.compiled_op("shoal_test_op", _on("cuda")) is None
    finally:
        dispatch.unregister_kernel("shoal_test_op")


def test_unbuilt_op_falls_back():
    assert dispatch.compiled_op("no_such_op", _on("cuda")) is None
