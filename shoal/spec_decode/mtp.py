"""`MtpProposer`: drafts with DeepSeek-V3's multi-token-prediction module
(shoal/models/deepseek_mtp.py), read from the target's own checkpoint (or `model` when given),
which the target's loader skips. It drafts as the EAGLE proposer does (shoal/spec_decode/eagle.py):
a pass over the step's rows, then a chain of argmax drafts; its hidden states are the target's
final ones, and its KV cache is one MLA layer's latent cache, of the target's blocks.

In a block-fp8 checkpoint the module's decoder layer is fp8 as the target's layers are (the
target's `quant_config`); the embedding and the output head are the target's own modules, so an RL
weight update of the target reaches them, and `load_weights` takes the module's own tensors by the
target checkpoint's names (`model.layers.{num_hidden_layers}.*`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from shoal.spec_decode.config import SpeculativeConfig
from shoal.spec_decode.eagle import Drafter, EagleProposer, build_context, load_checkpoint, tensor_names

logger = logging.getLogger(__name__)


class MtpProposer(EagleProposer):
    method = "mtp"

    def __init__(self, config: SpeculativeConfig, *, block_size: int = 16, target_path: str | None = None) -> None:
        """`target_path`: the target's checkpoint folder, where the module is read unless
        `config.model` names another."""
        super().__init__(config, block_size=block_size)
        self.folder = config.model or target_path

    def build_drafter(self, target_model: Any) -> Drafter:
        from shoal.config import load_hf_config
        from shoal.models.deepseek_mtp import DeepseekMTP, mtp_layer_index

        if self.folder is None:
            raise ValueError("the MTP proposer needs the checkpoint folder of its module (the target's)")
        hf_config = target_model.config if self.config.model is None else load_hf_config(self.folder)
        index = mtp_layer_index(hf_config)
        prefix = f"model.layers.{index}."
        files = _files_holding(self.folder, prefix)
        names = {name for name in tensor_names(self.folder, files) if name.startswith(prefix)}
        if not names:
            raise ValueError(
                f"checkpoint {self.folder!r} has no multi-token-prediction layer (no {prefix}* tensors); "
                "speculative_config method 'mtp' needs one"
            )
        if int(getattr(hf_config, "num_nextn_predict_layers", None) or 1) > 1:
            logger.info("drafting with the first of %d next-token modules", hf_config.num_nextn_predict_layers)
        quant_config = getattr(target_model, "quant_config", None)
        with build_context(self.dtype, self.device):
            module = DeepseekMTP(
                hf_config,
                target_model.model.rotary_emb,
                quant_config,
                eh_proj_quantized=f"{prefix}eh_proj.weight_scale_inv" in names,
            )
        unused = quant_config.is_unused_tensor if quant_config is not None else None
        load_checkpoint(
            module, self.folder, files, skip=lambda name: not name.startswith(prefix) or bool(unused and unused(name))
        )
        module.tie_to_target(target_model)
        logger.info("MTP module %s* loaded from %s", prefix, self.folder)
        return module.eval()


def _files_holding(folder: str, prefix: str) -> list[Path] | None:
    """The shards that hold tensors named `prefix`* (by the checkpoint's index; None: all)."""
    index = Path(folder) / "model.safetensors.index.json"
    if not index.exists():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    return [Path(folder) / name for name in sorted({f for n, f in weight_map.items() if n.startswith(prefix)})]
