"""Prometheus metrics at `GET /metrics`, named as vLLM names them with a `shoal:` prefix.

Token counts, latencies and finished requests come from the engine's stats listener (once per
batch of outputs). The gauges (running and waiting requests, KV-cache usage, used KV blocks)
are also refreshed from `AsyncLLM.get_stats()` on every scrape, so they are exact even after
requests that ended without an output (aborts). Every app has its own `CollectorRegistry`, so
several servers in one process never collide.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from shoal.frontend.stats import IterationStats
    from shoal.protocol import SchedulerStats

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0, 600.0)
_TOKEN_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_REQUEST_BUCKETS_S = (0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
_TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# Tokens per engine step: a decode step's handful up to a long prefill's budget.
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20, 50, 100)
# Why a request waits (`num_requests_waiting_by_reason`): for room in the batch (token budget,
# max_num_seqs, KV blocks; or the end of a pause), or for something else first (its grammar, or
# its KV from a prefill engine).
WAITING_REASONS = ("capacity", "deferred")


class ServerMetrics:
    def __init__(self, model_name: str, cache_config_info: dict[str, Any] | None = None) -> None:
        """`cache_config_info`: the KV cache's settings, served as the labels of
        `shoal:cache_config_info` (vLLM's info gauge)."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._last_cumulative: dict[str, int] = {}
        labels = ["model_name"]

        def counter(name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"shoal:{name}", doc, [*labels, *extra_labels], registry=self.registry)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(f"shoal:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(f"shoal:{name}", doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.request_success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(model_name)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(model_name)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (recomputed later).")
        # Speculative decoding (vLLM's names): advanced only by an engine that speculates.
        self.spec_decode_counters = {
            key: counter(key, doc).labels(model_name)
            for key, doc in (
                ("spec_decode_num_drafts", "Verifications of a request's draft tokens."),
                ("spec_decode_num_draft_tokens", "Draft tokens verified."),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            )
        }
        self.spec_decode_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the drafts.",
            ("position",),
        )
        # The host-memory tier (--kv-offload-bytes): zero without one.
        self.kv_offload_counters = {
            key: counter(key, doc).labels(model_name)
            for key, doc in (
                ("kv_offload_host_hit_tokens", "Prompt tokens loaded from the host KV tier instead of recomputed."),
                ("kv_offload_blocks_loaded", "KV blocks copied from the host tier back to the device."),
                ("kv_offload_blocks_offloaded", "KV blocks evicted from the device prefix cache to the host tier."),
            )
        }
        self.num_requests_running = gauge("num_requests_running", "Requests being computed.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.num_used_kv_blocks = gauge("num_used_kv_blocks", "KV-cache blocks held by requests.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS_S
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two output tokens.", _TOKEN_LATENCY_BUCKETS_S
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Decode time per output token, per request.", _TOKEN_LATENCY_BUCKETS_S
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to last token.", _REQUEST_BUCKETS_S
        )
        self.request_queue_time = histogram("request_queue_time_seconds", "Time waiting.", _REQUEST_BUCKETS_S)
        self.request_prefill_time = histogram("request_prefill_time_seconds", "Time prefilling.", _REQUEST_BUCKETS_S)
        self.request_decode_time = histogram("request_decode_time_seconds", "Time decoding.", _REQUEST_BUCKETS_S)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per request.", _TOKEN_COUNT_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per request.", _TOKEN_COUNT_BUCKETS
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Time running (prefill and decode).", _REQUEST_BUCKETS_S
        )
        self.request_prefill_kv_computed_tokens = histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens whose KV was computed (not found in the prefix cache), per request.",
            _TOKEN_COUNT_BUCKETS,
        )
        self.request_params_n = histogram("request_params_n", "The n parameter of each request.", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens",
            "The max_tokens of each request (capped by the context).",
            _TOKEN_COUNT_BUCKETS,
        )
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Generated tokens of the longest of a request's n completions.",
            _TOKEN_COUNT_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine step (prompt tokens computed and tokens sampled).",
            _STEP_TOKEN_BUCKETS,
        )
        waiting_by_reason = Gauge(
            "shoal:num_requests_waiting_by_reason",
            "Requests waiting, by reason: capacity (room in the batch) or deferred (a grammar being compiled, KV loading).",
            [*labels, "reason"],
            registry=self.registry,
        )
        self.num_requests_waiting_by_reason = {
            reason: waiting_by_reason.labels(model_name, reason) for reason in WAITING_REASONS
        }
        # vLLM's LoRA gauge, which Kubernetes routers read: one series, its labels the adapters of
        # the running and the waiting requests (comma-separated) and max_lora, its value the time.
        self.lora_requests_info = Gauge(
            "shoal:lora_requests_info",
            "Running and waiting LoRA adapters (as labels), and the value's time of the report.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )
        if cache_config_info is not None:
            info = {key: str(value) for key, value in cache_config_info.items()}
            cache_config = Gauge(
                "shoal:cache_config_info",
                "The KV cache's configuration (as labels).",
                [*labels, *info],
                registry=self.registry,
            )
            cache_config.labels(model_name, *info.values()).set(1)

    def on_stats(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        """The engine's stats listener: called once per batch of outputs."""
        if scheduler_stats is not None:
            self.set_engine_stats(
                {
                    "num_running_reqs": scheduler_stats.num_running_reqs,
                    "num_waiting_reqs": scheduler_stats.num_waiting_reqs,
                    "kv_cache_usage": scheduler_stats.kv_cache_usage,
                    "num_used_blocks": scheduler_stats.num_used_blocks,
                    "prefix_cache_queries": scheduler_stats.prefix_cache_queries,
                    "prefix_cache_hits": scheduler_stats.prefix_cache_hits,
                    "num_preemptions": scheduler_stats.num_preemptions,
                    "num_deferred_reqs": scheduler_stats.num_deferred_reqs,
                }
            )
            if scheduler_stats.max_loras:
                self.set_lora_info(scheduler_stats)
            num_step_tokens = scheduler_stats.num_prompt_tokens + scheduler_stats.num_generation_tokens
            if num_step_tokens:  # (an idle engine's reports are no steps)
                self.iteration_tokens.observe(num_step_tokens)
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(self.model_name, finished.finish_reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)
            self.request_queue_time.observe(finished.queued_time)
            self.request_prefill_time.observe(finished.prefill_time)
            self.request_decode_time.observe(finished.decode_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            self.request_inference_time.observe(finished.inference_time)
            self.request_prefill_kv_computed_tokens.observe(finished.num_prefill_kv_computed_tokens)
            if finished.num_generation_tokens > 1:
                self.time_per_output_token.observe(finished.decode_time / (finished.num_generation_tokens - 1))
        for prompt in iteration_stats.finished_prompts:
            self.request_params_n.observe(prompt.n)
            self.request_params_max_tokens.observe(prompt.max_tokens)
            self.request_max_num_generation_tokens.observe(prompt.max_num_generation_tokens)

    def set_lora_info(self, stats: SchedulerStats) -> None:
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(
            str(stats.max_loras), ",".join(stats.waiting_lora_adapters), ",".join(stats.running_lora_adapters)
        ).set_to_current_time()

    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        """Gauges and cumulative counters from the engine core's counters (`AsyncLLM.get_stats`)."""
        self.num_requests_running.set(stats.get("num_running_reqs", 0))
        self.num_requests_waiting.set(stats.get("num_waiting_reqs", 0))
        self.num_requests_waiting_by_reason["capacity"].set(stats.get("num_waiting_reqs", 0))
        self.num_requests_waiting_by_reason["deferred"].set(stats.get("num_deferred_reqs", 0))
        self.kv_cache_usage.set(stats.get("kv_cache_usage", 0.0))
        self.num_used_kv_blocks.set(stats.get("num_used_blocks", 0))
        self._advance(self.prefix_cache_queries.labels(self.model_name), "prefix_cache_queries", stats)
        self._advance(self.prefix_cache_hits.labels(self.model_name), "prefix_cache_hits", stats)
        self._advance(self.num_preemptions.labels(self.model_name), "num_preemptions", stats)
        if "spec_decode_num_drafts" in stats:
            self._advance_spec_decode(stats)
        for key, kv_offload_counter in self.kv_offload_counters.items():
            self._advance(kv_offload_counter, key, stats)

    def _advance_spec_decode(self, stats: dict[str, Any]) -> None:
        for key, counter in self.spec_decode_counters.items():
            self._advance(counter, key, stats)
        for position, value in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", [])):
            key = f"spec_decode_num_accepted_tokens_per_pos:{position}"
            self._advance(self.spec_decode_accepted_per_pos.labels(self.model_name, str(position)), key, {key: value})

    def _advance(self, counter: Any, key: str, stats: dict[str, Any]) -> None:
        """Move a Prometheus counter up to a cumulative value the engine core reports."""
        value = int(stats.get(key, 0))
        last = self._last_cumulative.get(key, 0)
        if value > last:
            counter.inc(value - last)
        self._last_cumulative[key] = max(value, last)

    def render(self) -> bytes:
        return generate_latest(self.registry)
