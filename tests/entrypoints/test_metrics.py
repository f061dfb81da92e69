"""Prometheus metrics and the periodic stats line, fed by hand (no engine)."""

from __future__ import annotations

from shoal.entrypoints.openai.metrics import ServerMetrics
from shoal.entrypoints.openai.stats_logger import StatsLogger
from shoal.frontend.stats import FinishedRequestStats, IterationStats
from shoal.protocol import SchedulerStats


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
