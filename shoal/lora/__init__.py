"""Multi-LoRA serving (docs/lora.md): adapters in PEFT's layout loaded at run time, kept in GPU
slots (LRU) with a CPU cache behind them, many in one batch through per-token slot indices."""

from shoal.lora.request import LoRARequest

__all__ = ["LoRARequest"]
