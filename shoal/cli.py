"""The `shoal` command: `shoal serve [MODEL] [--host ...] [--port ...] [engine arguments]` and
`shoal batch -i IN -o OUT [engine arguments]` and `shoal bench {throughput,latency,serve} [...]`.

Every engine argument is a flag generated from the `EngineArgs` dataclass (`max_model_len` →
`--max-model-len`, booleans as `--x/--no-x`), so a new engine argument is a new flag with no
change here. A subcommand is a function that adds its parser; `SUBCOMMANDS` lists them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import signal
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from shoal.config import DTYPES, EXECUTOR_BACKENDS, LOAD_FORMATS, LOGPROBS_MODES, PLACEMENT_STRATEGIES, EngineArgs

logger = logging.getLogger(__name__)

# Short aliases, as vLLM spells them.
_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"]}
_CHOICES: dict[str, Sequence[str]] = {
    "load_format": LOAD_FORMATS,
    "distributed_executor_backend": EXECUTOR_BACKENDS,
    "device": ("auto", "cpu", "cuda"),
    "placement_strategy": PLACEMENT_STRATEGIES,
    "logprobs_mode": LOGPROBS_MODES,
    "kv_transfer_role": ("prefill", "decode", "both"),
}
_HELP = {
    "model": "a local Hugging Face folder (config.json, safetensors, tokenizer) (default: the demo model)",
    "tokenizer": "the tokenizer's folder (default: the model's)",
    "served_model_name": "the model name the API answers to (default: the model path, or the demo model's name)",
    "dtype": f"weights and activations: auto (float32 on CPU, the checkpoint's half type on GPU) or one of {', '.join(DTYPES)}",
    "max_model_len": "the longest sequence (prompt + output) in tokens (default: the model's maximum)",
    "max_num_seqs": "the most requests running at once",
    "max_num_batched_tokens": "the token budget of one step; longer prompts are prefilled in chunks "
    "(default: 8192 on GPU, 2048 on CPU)",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse the KV cache of shared prompt prefixes",
    "gpu_memory_utilization": "the fraction of GPU memory shoal may use",
    "kv_cache_memory_bytes": "the KV cache's size; accepts 4GiB, 512MiB, ... "
    "(default: 1 GiB on CPU; on GPU what --gpu-memory-utilization leaves after the weights and activations)",
    "kv_offload_bytes": "keep blocks evicted from the prefix cache in this much host memory (pinned on GPU) and "
    "load them back on a hit instead of recomputing; accepts 4GiB, 512MiB, ... (default: 0, none)",
    "kv_transfer_role": "prefill/decode disaggregation: this engine saves (prefill) or loads (decode) the KV of "
    "requests that carry kv_transfer_params (default: neither; `--disaggregate` sets it)",
    "num_gpu_blocks_override": "force the number of KV-cache blocks (default: as many as the KV cache's size holds)",
    "load_format": "auto: the checkpoint's weights; dummy: random weights of the real shapes",
    "seed": "the engine's random seed",
    "device": "where the model runs",
    "enforce_eager": "never capture CUDA graphs",
    "batch_invariant": "a request's tokens and logprobs bitwise the same alone or in any batch (docs/batch_invariance.md)",
    "enable_sleep_mode": "GPU: weights and KV cache keep their addresses across sleep/wake_up (no CUDA-graph recapture)",
    "tensor_parallel_size": "GPUs (or CPU workers) each layer is split over",
    "pipeline_parallel_size": "pipeline stages, each a contiguous slice of layers",
    "distributed_executor_backend": "uni: one worker in the engine-core process; ray: Ray actors "
    "(default: ray with more than one worker or a placement group, else uni)",
    "pipeline_layer_partition": "layers per pipeline stage, e.g. 12 12 8 (default: as even as the layer count allows)",
    "quantization": "weight quantization: fp8 (default: none, or fp8 for an fp8 checkpoint)",
    "kv_cache_dtype": "the KV cache's dtype (auto: the model's)",
    "ray_address": "the Ray cluster to join (default: RAY_ADDRESS, else the one on this node, else a new local one)",
    "placement_strategy": "how Ray spreads the workers over nodes (PACK: TP within a node, PP across nodes)",
    "max_worker_restarts": "re-create a dead Ray worker at most this many times per window, then shut down (0: never)",
    "worker_restart_window_s": "the window, in seconds, over which --max-worker-restarts counts",
    "enable_expert_parallel": "MoE models: split whole experts across the tensor-parallel ranks",
    "async_scheduling": "schedule the next step while the device runs this one (default: on for one GPU worker)",
    "placement_group": "the name of a Ray placement group to run the workers in, made by a trainer and never removed "
    "(default: the engine makes its own)",
    "bundle_indices": "the placement group's bundles the workers take, in rank order, e.g. 2 1 "
    "(default: the driver node's bundles first)",
    "num_gpus_per_worker": "each Ray worker's share of a GPU (below 1 when a colocated trainer shares it)",
    "num_cpus_per_worker": "each Ray worker's logical CPUs (CPU workers)",
    "speculative_config": 'speculative decoding, as JSON: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
    "(methods: ngram, draft_model, eagle, eagle3, mtp; see docs/spec_decode.md) (default: none)",
    "kv_events_config": "publish KV-cache events for routers, vLLM's JSON: "
    '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "topic": ""}\' '
    "(replay_endpoint, buffer_steps, hwm too; docs/routing.md) (default: none)",
    "worker_extension_cls": "pkg.module:Class, a mixin added to every worker whose methods collective_rpc can call "
    "(default: none)",
    "enable_lora": "serve LoRA adapters (docs/lora.md)",
    "max_loras": "LoRA: the most adapters in one step (GPU slots); requests of others wait",
    "max_lora_rank": "LoRA: the largest adapter rank served",
    "max_cpu_loras": "LoRA: adapters kept loaded in host memory (default: --max-loras)",
    "lora_dtype": "LoRA: the adapters' dtype (auto: the model's)",
    "fully_sharded_loras": "LoRA: split A's rank (column-parallel) and B's output (row-parallel) across TP ranks too",
}
# Fields whose flag takes another form than their annotation: a placement group by its name.
_FLAG_TYPES: dict[str, Any] = {"placement_group": str, "speculative_config": str, "kv_events_config": str}
# The parsers' names (their modules import nothing heavy; spelled here so that --help needs no import).
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")
_SIZE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    # The command line as given: the router passes it on to the replicas it starts.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    return args.handler(args, parser)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default, once: `(default: X)` is added unless the help
    says its default itself (a default of None always needs the words: what "none" means) or
    the flag is a switch that is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if "(default" in help_text or switch or action.required or action.default in (None, argparse.SUPPRESS):
            return help_text
        return f"{help_text} (default: %(default)s)"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description="shoal: an LLM inference and serving engine")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


# ---- shoal serve -------------------------------------------------------------------------------


def add_serve_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over the OpenAI API",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, ...).",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model folder (default: the demo model)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    server.add_argument("--port", type=int, default=8000, help="the port to listen on (0: any free port)")
    server.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on the API routes (default: none, the routes are open)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=parse_size,
        default=10 * 1024 * 1024,
        help="larger bodies get a 413; accepts 4MiB, 512k, ... (default: 10 MiB)",
    )
    server.add_argument("--stats-interval", type=float, default=10.0, help="seconds between stats lines (0: off)")
    server.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the log level of the HTTP server (uvicorn: start-up, shutdown, access lines)",
    )
    server.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    server.add_argument(
        "--enable-rl-endpoints",
        action="store_true",
        help="add the RL rollout routes: /sleep, /wake_up, /is_sleeping, /pause, /resume, /is_paused",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to load at start, each name=path (or vLLM's JSON form); the OpenAI model field picks one",
    )
    server.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="add POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    limits = parser.add_argument_group("overload limits (docs/serving_limits.md)")
    limits.add_argument(
        "--max-num-waiting-requests",
        type=int,
        default=None,
        help="sequences that may wait beyond --max-num-seqs before new requests get a 429 "
        "(default: as many as the KV cache holds at a quarter of --max-model-len each)",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take before it is aborted with a 503 (default: no limit)",
    )
    limits.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a stream's client may stop reading before its request is aborted (0: no limit)",
    )
    server.add_argument(
        "--num-replicas",
        type=int,
        default=None,
        help="serve through Ray Serve with this many replicas, each one engine (shoal.serve_ray) "
        "(default: one engine, no Ray Serve); with --routing-policy, through shoal's router instead",
    )
    server.add_argument(
        "--routing-policy",
        default=None,
        choices=("cache_aware", "round_robin", "session"),
        help="with --num-replicas: N engine processes on this host behind shoal's router, which sends each "
        "request to the replica holding the longest cached prefix balanced against load (cache_aware), in turn "
        "(round_robin), or keeps each session on one replica (session) (docs/routing.md) (default: none: Ray Serve)",
    )
    server.add_argument(
        "--session-header",
        default="X-Session-Id",
        help="the request header naming a conversation, whose requests the router keeps on one replica",
    )
    server.add_argument(
        "--disaggregate",
        default=None,
        metavar="prefill=N,decode=M",
        help="prefill/decode disaggregation on Ray: N prefill and M decode engines behind this server, "
        "each request prefilled on one, its KV moved, decoded on another (docs/disaggregation.md) (default: one engine)",
    )
    server.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=10.0,
        help="with --disaggregate: seconds a decode engine waits for a request's KV; an engine silent this "
        "long x3 is taken for dead (the request is retried on others, then fails with 503) (default: 10)",
    )
    chat = parser.add_argument_group("chat outputs (tool calls, reasoning)")
    chat.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSER_NAMES),
        help="how the model writes tool calls: hermes (Hermes, Qwen2.5/3), llama3_json (Llama 3.x), mistral, "
        'deepseek_v3 or deepseek_v31 (DeepSeek-V3, V3.1) (default: none; tool_choice "auto" then gets a 400)',
    )
    chat.add_argument(
        "--enable-auto-tool-choice", action="store_true", help='let the model decide to call tools (tool_choice "auto")'
    )
    chat.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSER_NAMES),
        help="split a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3 "
        "(default: none: the thinking stays in content)",
    )
    add_engine_args(parser.add_argument_group("engine (shoal.config.EngineArgs)"))
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.entrypoints.openai.api_server import run_server

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    engine_args = engine_args_from(args)
    if args.model_tag is not None:
        engine_args = dataclasses.replace(engine_args, model=args.model_tag)
    server_args = server_args_from(args, parser)
    # SIGTERM ends the process through Python (unwinding, so the engine core is shut down)
    # rather than the default action; uvicorn handles it first for a graceful shutdown.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if args.routing_policy is not None:
            from shoal.routing.replicas import run_routed

            serve_argv = args.argv[args.argv.index("serve") + 1 :]
            run_routed(
                engine_args, server_args, args.num_replicas or 1, args.routing_policy, args.session_header, serve_argv
            )
        elif args.num_replicas is not None:
            from shoal.entrypoints.serve_ray import run_replicated

            run_replicated(engine_args, server_args, args.num_replicas)
        elif args.disaggregate is not None:
            from shoal.entrypoints.disaggregated.serve import run_disaggregated

            run_disaggregated(engine_args, server_args, args.disaggregate, args.kv_transfer_timeout)
        else:
            run_server(engine_args, server_args)
    except KeyboardInterrupt:
        pass
    except ValueError as exc:
        # Engine arguments are checked as the engine starts (with the config, which is built
        # while the engine-core process starts), so a bad one fails before the model loads.
        parser.exit(2, f"shoal serve: error: {exc}\n")
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    return 0


def server_args_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """The `ServerArgs` of parsed `shoal serve` flags."""
    from shoal.entrypoints.openai.api_server import ServerArgs
    from shoal.entrypoints.openai.serving_chat import ChatOptions

    return ServerArgs(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        stats_interval_s=args.stats_interval,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log,
        enable_rl_endpoints=args.enable_rl_endpoints,
        lora_modules=lora_modules_from(args, parser),
        enable_runtime_lora_updating=args.enable_runtime_lora_updating,
        limits=serving_limits_from(args, parser),
        chat=ChatOptions(
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
        ),
    )


def lora_modules_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[Any, ...]:
    from shoal.entrypoints.openai.lora_routes import parse_lora_module

    try:
        modules = tuple(parse_lora_module(text) for text in args.lora_modules)
    except ValueError as exc:
        parser.error(str(exc))
    if modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    return modules


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


# ---- shoal batch -------------------------------------------------------------------------------


def add_batch_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "batch",
        help="run a file of OpenAI requests (the batch format) offline",
        description=(
            "Answer every line of an OpenAI batch file (custom_id, method, url /v1/completions or "
            "/v1/chat/completions, body) as `shoal serve` would, one result line per request, written "
            "as it finishes (match them by custom_id). Rerun with the same output to resume."
        ),
        formatter_class=HelpFormatter,
    )
    parser.add_argument("-i", "--input", required=True, help="the requests, one JSON object a line")
    parser.add_argument("-o", "--output", required=True, help="the results file (appended to: a rerun resumes)")
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas, each TP x PP in its own placement group, through Ray Data",
    )
    parser.add_argument("--disable-progress-bar", action="store_true", help="no tqdm progress bar")
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters to load (with --enable-lora); a line's body.model picks one",
    )
    add_engine_args(parser.add_argument_group("engine (shoal.config.EngineArgs)"))
    parser.set_defaults(handler=run_batch_command)


def run_batch_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.entrypoints.batch import run_batch

    try:
        run_batch(
            engine_args_from(args),
            args.input,
            args.output,
            data_parallel_size=args.data_parallel_size,
            use_tqdm=not args.disable_progress_bar,
            lora_modules=lora_modules_from(args, parser),
        )
    except ValueError as exc:
        parser.exit(2, f"shoal batch: error: {exc}\n")
    except OSError as exc:
        logger.error("%s", exc)
        return 1
    return 0


def serving_limits_from(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    from shoal.entrypoints.openai.serving_limits import ServingLimits

    if args.max_num_waiting_requests is not None and args.max_num_waiting_requests < 0:
        parser.error("--max-num-waiting-requests must be >= 0")
    if args.request_timeout is not None and args.request_timeout <= 0:
        parser.error("--request-timeout must be > 0")
    if args.stream_stall_timeout < 0:
        parser.error("--stream-stall-timeout must be >= 0")
    return ServingLimits(
        max_num_waiting_requests=args.max_num_waiting_requests,
        request_timeout_s=args.request_timeout,
        stream_stall_timeout_s=args.stream_stall_timeout or None,
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


# ---- shoal cluster -----------------------------------------------------------------------------


def add_cluster_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("cluster", help="inspect the Ray cluster shoal runs on")
    commands = parser.add_subparsers(title="cluster commands", metavar="COMMAND")
    status = commands.add_parser(
        "status",
        help="nodes, their CPUs and GPUs (UUIDs), free resources, and the shoal engines with their placement groups",
    )
    status.add_argument("--address", default=None, help="the head's GCS host:port; none: RAY_ADDRESS or this node's")
    status.add_argument("--json", action="store_true", help="the report as JSON")
    status.set_defaults(handler=run_cluster_status)
    parser.set_defaults(handler=lambda args, _: _print_help(parser))


def run_cluster_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from shoal.entrypoints.cluster_status import main as cluster_status

    try:
        report = cluster_status(args.address, args.json)
    except ConnectionError as exc:
        sys.stderr.write(f"shoal cluster status: {exc}\n")
        return 1
    sys.stdout.write(report + "\n")
    return 0


# ---- flags generated from EngineArgs -----------------------------------------------------------


def add_engine_args(parser: Any) -> None:
    """One flag per `EngineArgs` field, typed from its annotation."""
    hints = typing.get_type_hints(EngineArgs)
    for field in dataclasses.fields(EngineArgs):
        names = ["--" + field.name.replace("_", "-"), *_ALIASES.get(field.name, [])]
        kind, element = _flag_type(_FLAG_TYPES.get(field.name, hints[field.name]))
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = _HELP.get(field.name, f"EngineArgs.{field.name}")
        if kind is bool:
            parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif kind in (tuple, list):
            parser.add_argument(*names, nargs="+", type=_converter(element), default=default, help=help_text)
        else:
            choices = _CHOICES.get(field.name)
            parser.add_argument(*names, type=_converter(kind), default=default, choices=choices, help=help_text)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(EngineArgs):
        value = getattr(args, field.name)
        values[field.name] = tuple(value) if isinstance(value, list) else value
    return EngineArgs(**values)


def _flag_type(annotation: Any) -> tuple[type, type | None]:
    """(the flag's type, the element type of a sequence) from a field annotation; Optional is
    dropped (a flag that is not given keeps the default)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"EngineArgs field type {annotation} has no flag form")
        annotation = members[0]
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        return origin, typing.get_args(annotation)[0]
    if annotation in (bool, int, float, str):
        return annotation, None
    raise TypeError(f"EngineArgs field type {annotation} has no flag form")


def _converter(kind: type | None) -> Callable[[str], Any]:
    return parse_size if kind is int else (kind or str)


def parse_size(text: str) -> int:
    """An integer, optionally with a decimal (k, M, G, T) or binary (KiB, MiB, GiB, TiB) suffix."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not an integer or size: {text!r}")
    number, unit, binary = match.groups()
    power = " KMGT".index(unit.upper()) if unit else 0
    value = float(number) * (1024 if binary else 1000) ** power
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


# ---- shoal bench -------------------------------------------------------------------------------


def add_bench_parser(subparsers: Any) -> None:
    """`shoal bench {throughput,latency,serve}`: each benchmark module adds its own parser."""
    from shoal.bench import latency, serve, throughput

    parser = subparsers.add_parser(
        "bench",
        help="benchmark offline throughput, batch latency or a running server",
        description="Benchmarks: offline throughput, batch latency, and online serving against `shoal serve`.",
    )
    benchmarks = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for module in (throughput, latency, serve):
        module.add_parser(benchmarks)
    parser.set_defaults(handler=lambda args, _: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


SUBCOMMANDS: list[Callable[[Any], None]] = [add_serve_parser, add_batch_parser, add_cluster_parser, add_bench_parser]


if __name__ == "__main__":
    sys.exit(main())
