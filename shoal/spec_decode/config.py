"""`SpeculativeConfig`: which proposer drafts tokens, how many a step, and when speculation is off.

The names are vLLM's (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'`).
Everything that can be checked without the target model is checked when the config is built
(`SpeculativeConfig(...)` or `from_json`); `validate_against` adds the checks that need the
target's config (vocabulary, hidden size, MTP layers, tensor parallelism). Both raise `ValueError`
saying what is wrong, before any weight loads. This module imports no torch (the engine core
reads the config).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.config import ModelConfig, ParallelConfig

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# Methods whose drafter is a model of its own, read from `model` (a folder with a config.json).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# Methods whose drafter reads the target's hidden states (and runs beside it on every step).
HIDDEN_STATE_METHODS = ("eagle", "eagle3", "mtp")
# vLLM's prompt-lookup window when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates.

    - `method`: `ngram` (prompt lookup over each request's own tokens, no model), `draft_model`
      (a smaller model of the same vocabulary), `eagle` / `eagle3` (a head reading the target's
      hidden states), `mtp` (the target's own multi-token-prediction layers, DeepSeek-V3).
    - `num_speculative_tokens`: k, the most draft tokens a request carries into a step; the
      target scores k + 1 positions of it (the drafts and one bonus position).
    - `model`: the draft model's or head's folder; required for `draft_model`, `eagle` and
      `eagle3`; for `mtp` the target's own checkpoint when None.
    - `prompt_lookup_min` / `prompt_lookup_max` (`ngram` only): the n-gram lengths matched; both
      5 when neither is given, the other bound when one is (vLLM's rules).
    - `draft_tensor_parallel_size`: the drafter's tensor parallelism, 1 or the target's (None:
      the target's).
    - `disable_by_batch_size`: a step with more running requests than this runs without drafts
      (at least 2; None: never off by batch size).
    - `accept_all_drafts`: FOR BENCHMARKS ONLY. Every draft is accepted unverified, so the output
      is not the target model's; it prices the verification forward alone, at the acceptance
      rate of a perfect drafter.
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_tensor_parallel_size: int | None = None
    disable_by_batch_size: int | None = None
    accept_all_drafts: bool = False

    def __post_init__(self) -> None:
        _require(
            self.method in METHODS,
            f"speculative_config method must be one of {', '.join(METHODS)}, got {self.method!r}",
        )
        _require_int("num_speculative_tokens", self.num_speculative_tokens, minimum=1)
        _require(isinstance(self.accept_all_drafts, bool), "speculative_config accept_all_drafts must be true or false")
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_model_based()
        if self.disable_by_batch_size is not None:
            _require_int("disable_by_batch_size", self.disable_by_batch_size, minimum=2)

    def _check_ngram(self) -> None:
        """Prompt lookup has no model: no folder, no draft parallelism; its window's bounds are
        filled in by vLLM's rules and must satisfy 1 <= min <= max."""
        _require(
            self.model is None,
            "speculative_config method 'ngram' takes no model (it drafts from each request's own tokens)",
        )
        _require(
            self.draft_tensor_parallel_size is None,
            "speculative_config draft_tensor_parallel_size applies to model-based methods, not 'ngram'",
        )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        _require_int("prompt_lookup_min", low, minimum=1)
        _require_int("prompt_lookup_max", high, minimum=1)
        assert low is not None and high is not None
        _require(low <= high, f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        object.__setattr__(self, "prompt_lookup_min", low)  # a frozen dataclass fills its defaults once
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_model_based(self) -> None:
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _require(getattr(self, name) is None, f"speculative_config {name} applies to method 'ngram' only")
        if self.model is None:
            _require(
                self.method not in MODEL_METHODS,
                f"speculative_config method {self.method!r} needs model: the folder of its draft model or head",
            )
        else:
            _require(isinstance(self.model, str), f"speculative_config model must be a folder path, got {self.model!r}")
            _require_checkpoint_folder(self.model)
        if self.draft_tensor_parallel_size is not None:
            _require_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, minimum=1)

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """The config of `--speculative-config '<json>'` (a JSON object) or of a dict of the same
        keys; unknown keys are refused by name."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if "tensor_parallel_size" in unknown:
            raise ValueError(
                "speculative_config has no tensor_parallel_size: the drafter's is draft_tensor_parallel_size"
            )
        _require(not unknown, f"unknown speculative_config key(s) {unknown}; the keys are {known}")
        for name in ("method", "num_speculative_tokens"):
            _require(name in value, f"speculative_config needs {name}")
        return cls(**value)

    # ---- what the engine asks of it ------------------------------------------------------------

    @property
    def uses_target_hidden_states(self) -> bool:
        """The drafter reads the target's hidden states (EAGLE heads, MTP layers)."""
        return self.method in HIDDEN_STATE_METHODS

    def speculates_at(self, num_running_reqs: int) -> bool:
        """Whether a step with this many running requests carries drafts (`disable_by_batch_size`)."""
        return self.disable_by_batch_size is None or num_running_reqs <= self.disable_by_batch_size

    def drafter_path(self, model_config: ModelConfig) -> str | None:
        """The folder the drafter's weights load from: `model`, the target's own checkpoint for
        `mtp` without one, None for `ngram`."""
        if self.method == "ngram":
            return None
        return self.model or model_config.model

    def validate_against(self, model_config: ModelConfig, parallel_config: ParallelConfig | None = None) -> None:
        """The checks that need the target model: the drafter's config.json against the target's
        (same vocabulary, a head's hidden size, MTP layers present) and the draft tensor
        parallelism against the target's. Raises `ValueError`."""
        if parallel_config is not None and self.draft_tensor_parallel_size is not None:
            tp = parallel_config.tensor_parallel_size
            _require(
                self.draft_tensor_parallel_size in (1, tp),
                f"speculative_config draft_tensor_parallel_size must be 1 or the target's tensor_parallel_size ({tp}), "
                f"got {self.draft_tensor_parallel_size}",
            )
        if self.method == "draft_model":
            self._validate_draft_model(model_config)
        elif self.method in ("eagle", "eagle3"):
            self._validate_head(model_config)
        elif self.method == "mtp":
            self._validate_mtp(model_config)

    def _validate_draft_model(self, model_config: ModelConfig) -> None:
        assert self.model is not None
        draft = read_checkpoint_config(self.model)
        _require_same_vocabulary(draft, model_config, "draft model")
        from shoal.models.registry import supported_architectures

        architectures = list(draft.get("architectures") or [])
        _require(
            any(name in supported_architectures() for name in architectures),
            f"speculative_config draft model architectures {architectures} are not supported; "
            f"shoal supports {sorted(supported_architectures())}",
        )

    def _validate_head(self, model_config: ModelConfig) -> None:
        """An EAGLE head reads the target's hidden states (an EAGLE-3 head, the fused features of
        three layers, each of the target's width; its config may name that width
        `target_hidden_size`) and predicts over the target's vocabulary (an EAGLE-3 head may
        draft from a smaller one, `draft_vocab_size`, mapped onto the target's)."""
        assert self.model is not None
        head = read_checkpoint_config(self.model)
        _require_same_vocabulary(head, model_config, f"{self.method} head")
        target_width = int(model_config.hf_config.hidden_size)
        head_width = head.get("target_hidden_size") or head.get("hidden_size")
        _require(
            head_width is None or int(head_width) == target_width,
            f"speculative_config {self.method} head {self.model!r} reads hidden states of width {head_width}, "
            f"the target's are {target_width}",
        )

    def _validate_mtp(self, model_config: ModelConfig) -> None:
        if self.model is None:
            num_layers = getattr(model_config.hf_config, "num_nextn_predict_layers", None) or 0
            where = f"the target {model_config.model!r}"
        else:
            num_layers = read_checkpoint_config(self.model).get("num_nextn_predict_layers") or 0
            where = repr(self.model)
        _require(
            int(num_layers) > 0,
            f"speculative_config method 'mtp' needs multi-token-prediction layers, and {where} has none "
            "(num_nextn_predict_layers is 0 or missing in its config.json)",
        )


def read_checkpoint_config(folder: str) -> dict[str, Any]:
    """A drafter folder's config.json as a dict (read as JSON: an EAGLE head's architecture is not
    one transformers knows)."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"speculative_config model {folder!r}: cannot read its config.json ({exc})") from None
    _require(isinstance(config, dict), f"speculative_config model {folder!r}: its config.json is not a JSON object")
    return config


def _require_checkpoint_folder(folder: str) -> None:
    _require(Path(folder).is_dir(), f"speculative_config model {folder!r} is not a local directory")
    _require(
        (Path(folder) / "config.json").is_file(),
        f"speculative_config model {folder!r} has no config.json (a Hugging Face checkpoint folder is expected)",
    )


def _require_same_vocabulary(drafter: dict[str, Any], model_config: ModelConfig, what: str) -> None:
    """Drafts are token ids of the target's vocabulary: the drafter's must be the same size."""
    vocab_size = drafter.get("vocab_size")
    _require(
        vocab_size is None or int(vocab_size) == model_config.vocab_size,
        f"speculative_config {what} has a vocabulary of {vocab_size} tokens, the target's has "
        f"{model_config.vocab_size}: drafts must be tokens of the target's vocabulary",
    )


def _require_int(name: str, value: Any, minimum: int) -> None:
    _require(
        isinstance(value, int) and not isinstance(value, bool),
        f"speculative_config {name} must be an integer, got {value!r}",
    )
    _require(value >= minimum, f"speculative_config {name} must be >= {minimum}, got {value}")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
