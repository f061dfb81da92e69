"""`LLM`: offline batched generation with the names vLLM users know.

from shoal import LLM, SamplingParams
llm = LLM()  # the demo model; or LLM("path/to/hf-folder", dtype="bfloat16", ...)
outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from shoal import envs
from shoal.config import EngineArgs
from shoal.errors import GenerationHeldError
from shoal.frontend.beam_search import BeamSearch, BeamSearchOutput, step_params
from shoal.frontend.chat import Conversation, render_chat
from shoal.frontend.core_client import EngineCoreClient, InprocClient, SyncMPClient
from shoal.frontend.input_processor import PromptType
from shoal.frontend.lora_adapters import LoRAAdapters, as_lora_list
from shoal.frontend.output_processor import OutputKind
from shoal.frontend.startup import start_engine
from shoal.frontend.verb_methods import install_verb_methods, sync_method
from shoal.lora.request import LoRARequest
from shoal.outputs import PositionLogprobs, RequestOutput
from shoal.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)


def profile_directory(profile_dir: str | None) -> str:
    """Where workers write profiler traces: the given folder, else $SHOAL_TORCH_PROFILER_DIR (an
    absolute path: the workers may run in another directory)."""
    profile_dir = profile_dir or envs.SHOAL_TORCH_PROFILER_DIR
    if not profile_dir:
        raise ValueError("start_profile needs a directory: pass profile_dir or set SHOAL_TORCH_PROFILER_DIR")
    return str(Path(profile_dir).resolve())


class LLM:
    """An engine for offline generation. Keyword arguments are `EngineArgs` fields
    (dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    enable_prefix_caching, load_format, seed, device, tensor_parallel_size, ...).

    The engine core runs in a separate process (spawned: create the LLM under
    `if __name__ == "__main__":` in scripts); `multiprocess=False` keeps it in this process."""

    def __init__(self, model: str | None = None, *, multiprocess: bool = True, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
        if unknown:
            raise ValueError(f"unknown LLM arguments {unknown}; see shoal.config.EngineArgs")
        # By default the engine core runs in its own process; multiprocess=False keeps it here.
        self.engine_core: EngineCoreClient = SyncMPClient() if multiprocess else InprocClient()
        self.config, self.tokenizer, self.input_processor, self.output_processor = start_engine(
            self.engine_core, EngineArgs(model=model, **kwargs)
        )
        self._request_counter = itertools.count()
        self.lora_adapters = LoRAAdapters(self.config.lora_config is not None)

    # ---- generation ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt, batched by the engine; outputs come back in
        the order of the prompts. `lora_request`: the adapter of every prompt, or a list with one
        per prompt (None: the base model)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        lora_names = self._lora_names(lora_request, len(prompt_list))
        tokenized = [self.input_processor.tokenize(p) for p in prompt_list]
        return self._run(tokenized, params_list, use_tqdm, lora_names)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the chat template (which
        also renders `tools`, OpenAI's function definitions, where it knows how)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = [
            render_chat(self.tokenizer, c, add_generation_prompt, chat_template, chat_template_kwargs, tools)
            for c in conversations  # type: ignore[arg-type]
        ]
        lora_names = self._lora_names(lora_request, len(rendered))
        return self._run(rendered, _as_params_list(sampling_params, len(rendered)), use_tqdm, lora_names)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's offline API; shoal/frontend/beam_search.py): per prompt, its
        `params.beam_width` best beams, best first, each with `tokens` (the prompt's and the
        generated), `text`, `cum_logprob` and `score`. Every round of the search is one batch
        of the engine: all live beams of all prompts, one token each."""
        tokenized = [self.input_processor.tokenize(p) for p in _as_prompt_list(prompts)]
        for _, token_ids in tokenized:
            self.input_processor.validate_prompt(token_ids)
        eos_token_ids = self.input_processor.stop_token_ids()
        max_model_len = self.config.model_config.max_model_len
        searches = [BeamSearch(token_ids, params, eos_token_ids, max_model_len) for _, token_ids in tokenized]
        step = step_params(params)
        bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True, disable=not use_tqdm)
        with bar:
            while live := [search for search in searches if not search.done]:
                beam_prompts = [(search, beam) for search in live for beam in search.prompts()]
                outputs = self._run([(None, beam) for _, beam in beam_prompts], [step] * len(beam_prompts), False)
                rows = iter(_first_row(output) for output in outputs)
                for search in live:
                    search.advance([next(rows) for _ in search.live])
                bar.update(1)
        return [search.output(self.tokenizer) for search in searches]

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        lora_names: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        for (_, token_ids), params in zip(prompts, params_list):
            # Fail before anything is queued.
            self.input_processor.validate_prompt(token_ids)
            self.input_processor.validate_params(params)
        self._check_not_held()
        order = {}
        for (text, token_ids), params, lora_name in zip(prompts, params_list, lora_names or [None] * len(prompts)):
            request_id = str(next(self._request_counter))
            order[request_id] = len(order)
            self._add_request(request_id, text, token_ids, params, lora_name)
        finished = self._run_engine(len(prompts), use_tqdm)
        return sorted(finished, key=lambda o: order[o.request_id])

    def _add_request(
        self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams, lora_name: str | None
    ) -> None:
        children = self.output_processor.add_request(request_id, text, token_ids, params, OutputKind.FINAL_ONLY)
        arrival = time.time()
        for child_id, child_params in children:
            request = self.input_processor.process(child_id, token_ids, child_params, arrival, lora_name)
            self.engine_core.add_request(request)

    def _run_engine(self, num_prompts: int, use_tqdm: bool) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        bar = tqdm(total=num_prompts, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        num_in, num_out = 0, 0
        try:
            while self.output_processor.has_unfinished_requests():
                outputs = self.engine_core.get_output()
                processed = self.output_processor.process_outputs(outputs.outputs, outputs.weight_version)
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                for output in processed.request_outputs:
                    finished.append(output)
                    num_in += len(output.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {num_in / elapsed:.0f} toks/s, output: {num_out / elapsed:.0f} toks/s")
                    bar.update(1)
        except BaseException:
            self._abort_all()
            raise
        finally:
            bar.close()
        return finished

    def _check_not_held(self) -> None:
        """Requests on an engine that is asleep or paused would wait for a call that this
        thread, blocked in generate, could never make: fail instead."""
        hold = self._call("generation_hold")
        if hold is not None:
            raise GenerationHeldError(f"{hold} (LLM.generate would wait forever)")

    def _abort_all(self) -> None:
        for request_id in list(self.output_processor.parents):
            self.engine_core.abort_requests(self.output_processor.abort_request(request_id))

    # ---- engine control ------------------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def collective_rpc(
        self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Call a method on every worker and return each worker's result (rank order)."""
        return self.engine_core.call_utility("collective_rpc", method, args, kwargs, timeout)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.call_utility("reset_prefix_cache")

    # ---- LoRA adapters (docs/lora.md) ------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on every worker (a ValueError says what is wrong with a bad one)."""
        if self.lora_adapters.needs_loading(lora_request):
            self._call("add_lora", lora_request.lora_name, lora_request.lora_int_id, lora_request.path)
            self.lora_adapters.loaded[lora_request.lora_name] = lora_request
        return True

    def remove_lora(self, lora_name: str) -> bool:
        self._call("remove_lora", lora_name)
        self.lora_adapters.loaded.pop(lora_name, None)
        return True

    def list_loras(self) -> dict[str, int]:
        """Adapter name → lora_int_id, as the engine holds them."""
        return self._call("list_loras")

    def update_lora_weights_from_tensors(self, lora_name: str, named_tensors: Any) -> str:
        """Replace a loaded adapter's weights in place (RL: a LoRA policy after a training step):
        `named_tensors` (pairs or a dict) named as PEFT names them (`...q_proj.lora_A.weight`,
        `get_peft_model_state_dict`), scaled by the adapter's adapter_config.json. Returns the
        adapter's new weight version."""
        from shoal.lora.tensors import encode_tensors

        return self._call("update_lora_from_tensors", lora_name, encode_tensors(named_tensors))

    def update_lora_weights_from_disk(self, lora_name: str, lora_path: str) -> str:
        """Replace a loaded adapter in place by the one saved at `lora_path` (PEFT's layout);
        returns the adapter's new weight version."""
        version = self._call("update_lora_from_disk", lora_name, lora_path)
        known = self.lora_adapters.loaded[lora_name]
        self.lora_adapters.loaded[lora_name] = LoRARequest(lora_name, known.lora_int_id, lora_path)
        return version

    def get_lora_version(self, lora_name: str) -> str:
        """The weight version of a loaded adapter: "0" as loaded, one more after each update."""
        return self._call("get_lora_version", lora_name)

    def _lora_names(
        self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
    ) -> list[str | None]:
        requests = as_lora_list(lora_request, num_prompts)
        for request in {r.lora_name: r for r in requests if r is not None}.values():
            self.add_lora(request)
        return [self.lora_adapters.name_of(r) for r in requests]

    # ---- RL rollouts (docs/rl.md) --------------------------------------------------------------
    # sleep / wake_up, pause_generation / resume_generation, the weight updates, ...: one method
    # per verb of shoal/rl_verbs.py, made from its declaration (install_verb_methods, below).

    def _call(self, method: str, *args: Any) -> Any:
        return self.engine_core.call_utility(method, *args)

    @property
    def weight_version(self) -> str:
        """The version of the weights the engine runs now ("0" until the first update)."""
        return self.get_weight_version()

    def start_profile(self, profile_dir: str | None = None) -> None:
        """Run torch.profiler on every worker, where the model runs (the engine-core process or
        its Ray actors), until `stop_profile`. Traces go to `profile_dir`, else to
        $SHOAL_TORCH_PROFILER_DIR."""
        self.collective_rpc("start_profile", (profile_directory(profile_dir),))

    def stop_profile(self) -> list[dict[str, Any]]:
        """Stop the profile; per worker (rank order): its Chrome trace's path, the wall seconds
        profiled, the seconds its device was busy (None on CPU) and a table of the top ops."""
        return self.collective_rpc("stop_profile")

    def get_stats(self) -> dict[str, Any]:
        """The engine core's counters: running/waiting requests, used KV blocks, prefix cache."""
        return self.engine_core.call_utility("get_stats")

    def shutdown(self) -> None:
        """Stop the engine: the engine-core process, the Ray worker actors and the placement
        group the engine made (not one it was given), and with them their device memory.
        Idempotent; dropping the last reference and leaving `with LLM(...)` do the same."""
        client = getattr(self, "engine_core", None)
        if client is not None:
            client.shutdown()
            self.engine_core = None  # type: ignore[assignment]

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


install_verb_methods(LLM, sync_method)


def _first_row(output: RequestOutput) -> PositionLogprobs:
    """A one-token request's logprobs row (empty if it was aborted before its token)."""
    logprobs = output.outputs[0].logprobs
    return logprobs[0] if logprobs else {}


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("no prompts given")
    return prompt_list


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    params_list = list(params)
    if len(params_list) != num_prompts:
        raise ValueError(f"got {len(params_list)} sampling params for {num_prompts} prompts")
    if not all(isinstance(p, SamplingParams) for p in params_list):
        raise ValueError("sampling_params must be SamplingParams objects")
    return params_list
