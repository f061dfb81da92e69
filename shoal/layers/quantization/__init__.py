"""Number formats for the weights of linear layers.

A linear layer keeps its tensor-parallel sharding and delegates how its weight is stored and
multiplied to a `LinearMethod` (base.py): float (`UnquantizedLinearMethod`) or fp8
(`Fp8LinearMethod`, fp8.py). `Fp8Config` (fp8_config.py, which imports no torch) says which
layers are fp8 and how, from a checkpoint's `quantization_config` or `quantization="fp8"`.

This package's `__init__` imports nothing, so that shoal/config.py can read fp8_config without torch.
"""
