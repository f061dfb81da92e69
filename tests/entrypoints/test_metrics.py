"""Prometheus metrics and the periodic stats line, fed by hand (no engine), and vLLM's series
scraped from the session server after requests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shoal.entrypoints.openai.metrics import ServerMetrics
from shoal.entrypoints.openai.stats_logger import StatsLogger
from shoal.frontend.stats import FinishedPromptStats, FinishedRequestStats, IterationStats
from shoal.protocol import SchedulerStats
from tests.entrypoints.server_utils import ServerProcess


def _iteration(num_prompt_tokens: int = 0, num_generation_tokens: int = 0, finished: bool = False) -> IterationStats:
    done = [FinishedRequestStats("stop", 1.5, 10, 5, 0.1, 0.2, 1.2)] if finished else []
    return IterationStats(num_prompt_tokens, num_generation_tokens, [0.3], [0.05, 0.06], done)


def test_metrics_follow_stats() -> None:
    metrics = ServerMetrics("m")
    scheduler_stats = SchedulerStats(
        num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, num_used_blocks=7, prefix_cache_queries=100
    )
    metrics.on_stats(scheduler_stats, _iteration(10, 3, finished=True))
    metrics.set_engine_stats({"prefix_cache_queries": 150, "prefix_cache_hits": 40, "num_used_blocks": 0})
    text = metrics.render().decode()
    assert 'shoal:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'shoal:prompt_tokens_total{model_name="m"} 10.0' in text
    assert 'shoal:generation_tokens_total{model_name="m"} 3.0' in text
    assert 'shoal:prefix_cache_queries_total{model_name="m"} 150.0' in text
    assert 'shoal:prefix_cache_hits_total{model_name="m"} 40.0' in text
    assert 'shoal:num_used_kv_blocks{model_name="m"} 0.0' in text
    assert 'shoal:time_to_first_token_seconds_count{model_name="m"} 1.0' in text
    assert 'shoal:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'shoal:e2e_request_latency_seconds_sum{model_name="m"} 1.5' in text
    assert 'shoal:time_per_output_token_seconds_sum{model_name="m"} 0.3' in text


def test_two_apps_do_not_collide() -> None:
    first, second = ServerMetrics("a"), ServerMetrics("b")
    first.on_stats(None, _iteration(5, 1))
    assert 'shoal:prompt_tokens_total{model_name="b"} 0.0' in second.render().decode()


def test_stats_line() -> None:
    stats_logger = StatsLogger(engine=None, interval_s=10.0)  # type: ignore[arg-type]
    stats_logger._last_time = 0.0
    stats_logger.on_stats(None, _iteration(1000, 200))
    stats = {"num_running_reqs": 3, "num_waiting_reqs": 1, "kv_cache_usage": 0.125}
    line = stats_logger.format_line({**stats, "prefix_cache_queries": 100, "prefix_cache_hits": 25}, now=10.0)
    assert line == (
        "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%"
    )
    idle = {"prefix_cache_queries": 100, "prefix_cache_hits": 25}
    assert stats_logger.format_line(idle, now=20.0) is not None  # the first idle interval is logged
    assert stats_logger.format_line(idle, now=30.0) is None  # later ones are not


def test_vllms_request_and_step_metrics_follow_stats() -> None:
    metrics = ServerMetrics("m", {"block_size": 16, "enable_prefix_caching": True, "num_gpu_blocks": 100})
    done = FinishedRequestStats("stop", 1.5, 10, 5, 0.1, 0.2, 1.2, num_prefill_kv_computed_tokens=6)
    iteration = IterationStats(10, 1, finished_requests=[done], finished_prompts=[FinishedPromptStats(2, 16, 5)])
    metrics.on_stats(
        SchedulerStats(num_waiting_reqs=3, num_deferred_reqs=1, num_prompt_tokens=10, num_generation_tokens=1),
        iteration,
    )
    metrics.on_stats(SchedulerStats(), IterationStats())  # an idle report is no step
    text = metrics.render().decode()
    assert (
        'shoal:cache_config_info{block_size="16",enable_prefix_caching="True",model_name="m",num_gpu_blocks="100"} 1.0'
        in text
    )
    assert 'shoal:iteration_tokens_total_count{model_name="m"} 1.0' in text
    assert 'shoal:iteration_tokens_total_sum{model_name="m"} 11.0' in text
    assert 'shoal:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 0.0' in text
    metrics.set_engine_stats({"num_waiting_reqs": 3, "num_deferred_reqs": 1})
    text = metrics.render().decode()
    assert 'shoal:num_requests_waiting_by_reason{model_name="m",reason="capacity"} 3.0' in text
    assert 'shoal:num_requests_waiting_by_reason{model_name="m",reason="deferred"} 1.0' in text
    assert 'shoal:request_inference_time_seconds_sum{model_name="m"} 1.4' in text
    assert 'shoal:request_prefill_kv_computed_tokens_sum{model_name="m"} 6.0' in text
    assert 'shoal:request_params_n_sum{model_name="m"} 2.0' in text
    assert 'shoal:request_params_max_tokens_sum{model_name="m"} 16.0' in text
    assert 'shoal:request_max_num_generation_tokens_sum{model_name="m"} 5.0' in text


def _scrape(server: ServerProcess) -> tuple[dict[str, float], dict[str, dict[str, str]]]:
    """sample name (labels but model_name and le summed over) -> value; and each sample's labels."""
    values: dict[str, float] = {}
    labels: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=30).text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            extra = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            name = f"{sample.name}{{{extra}}}" if extra and family.name != "shoal:cache_config_info" else sample.name
            values[name] = values.get(name, 0.0) + sample.value
            labels[name] = sample.labels
    return values, labels


def test_vllms_metrics_after_requests(server: ServerProcess) -> None:
    """vLLM's series of its metrics test, with values that follow from the requests made: two
    prompts with n=1 and one with n=2, 6 tokens each."""
    max_tokens, prompt = 6, "Metrics test: the colours of the rainbow are"
    before, _ = _scrape(server)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for n in (1, 1, 2):
            body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "ignore_eos": True, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
    after, labels = _scrape(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    num_completions, num_prompts = 4, 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"shoal:request_{phase}_time_seconds_count") == num_completions
    assert delta("shoal:request_generation_tokens_sum") == num_completions * max_tokens
    assert delta("shoal:request_params_n_count") == num_prompts
    assert delta("shoal:request_params_n_sum") == 4
    assert delta("shoal:request_params_max_tokens_sum") == num_prompts * max_tokens
    assert delta("shoal:request_max_num_generation_tokens_sum") == num_prompts * max_tokens
    assert delta("shoal:request_prefill_kv_computed_tokens_count") == num_completions
    computed = delta("shoal:request_prefill_kv_computed_tokens_sum")
    assert 0 < computed <= delta("shoal:request_prompt_tokens_sum")
    # One step per token of each prompt (its two completions run together, or one step apart
    # when a step starts between their arrivals); every step's tokens are the prompt tokens it
    # computed and the tokens it sampled.
    assert num_prompts * max_tokens <= delta("shoal:iteration_tokens_total_count") <= num_prompts * max_tokens + 1
    assert delta("shoal:iteration_tokens_total_sum") == computed + num_completions * max_tokens
    assert after["shoal:num_requests_waiting_by_reason{reason=capacity}"] == 0
    assert after["shoal:num_requests_waiting_by_reason{reason=deferred}"] == 0
    assert "shoal:num_preemptions_total" in after
    # A completion that a stop string ends (in the frontend) is a finished request too.
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stopped = http.post("/v1/completions", json={**body, "stop": [text[-3:]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    final, _ = _scrape(server)
    assert (
        final["shoal:request_success_total{finished_reason=stop}"]
        - after.get("shoal:request_success_total{finished_reason=stop}", 0.0)
        == 1
    )
    assert final["shoal:request_params_n_count"] - after["shoal:request_params_n_count"] == 2
    cache = labels["shoal:cache_config_info"]
    assert (cache["block_size"], cache["enable_prefix_caching"]) == ("16", "True")
    assert int(cache["num_gpu_blocks"]) > 0


def test_spec_decode_metrics_and_stats_line() -> None:
    """vLLM's spec_decode_* counters follow the engine's cumulative counts; the stats line shows
    the interval's acceptance rate and mean accepted length."""
    metrics = ServerMetrics("m")
    spec = {
        "spec_decode_num_drafts": 10,
        "spec_decode_num_draft_tokens": 30,
        "spec_decode_num_accepted_tokens": 12,
        "spec_decode_num_accepted_tokens_per_pos": [7, 4, 1],
    }
    metrics.set_engine_stats(spec)
    metrics.set_engine_stats(
        {**spec, "spec_decode_num_drafts": 14, "spec_decode_num_accepted_tokens_per_pos": [9, 4, 1]}
    )
    text = metrics.render().decode()
    assert 'shoal:spec_decode_num_drafts_total{model_name="m"} 14.0' in text
    assert 'shoal:spec_decode_num_draft_tokens_total{model_name="m"} 30.0' in text
    assert 'shoal:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0' in text
    assert 'shoal:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0' in text
    assert 'shoal:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text
    stats_logger = StatsLogger(engine=None, interval_s=10.0)  # type: ignore[arg-type]
    stats_logger._last_time = 0.0
    stats_logger.on_stats(None, _iteration(0, 22))
    line = stats_logger.format_line({"num_running_reqs": 1, **spec}, now=10.0)
    assert line is not None and line.endswith(", Draft acceptance rate: 40.0%, Mean accepted length: 2.20")
    assert "Draft acceptance rate" not in (stats_logger.format_line({"num_running_reqs": 1, **spec}, now=20.0) or "")
