"""Speculative decoding: proposers of draft tokens and the rejection sampler that verifies them.

The package imports neither torch nor numpy here: the engine core reads `SpeculativeConfig`
(shoal/spec_decode/config.py) and loads no torch.
"""
