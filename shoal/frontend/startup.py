"""How `LLM` and `AsyncLLM` start: the engine core first, then this process's own parts.

A multiprocess client spawns the engine-core process when it is made, so that process's imports
(torch, the model code: seconds) overlap with building the config and loading the tokenizer here.
"""

from __future__ import annotations

from typing import Any

from shoal.config import EngineArgs, EngineConfig
from shoal.frontend.input_processor import InputProcessor
from shoal.frontend.output_processor import OutputProcessor
from shoal.frontend.tokenizer import get_tokenizer


def start_engine(client: Any, engine_args: EngineArgs) -> tuple[EngineConfig, Any, InputProcessor, OutputProcessor]:
    """Build the config, hand it to the client's engine core, load the tokenizer and the
    processors while the core builds, then wait for it: (config, tokenizer, input processor,
    output processor). On any failure the client is shut down and the error raised."""
    try:
        config = engine_args.create_engine_config()
        client.start(config)
        tokenizer = get_tokenizer(config.model_config.tokenizer)
        input_processor, output_processor = InputProcessor(config.model_config, tokenizer), OutputProcessor(tokenizer)
        input_processor.speculates = config.speculative_config is not None
        client.wait_until_ready()
    except BaseException:
        client.shutdown()
        raise
    return config, tokenizer, input_processor, output_processor
