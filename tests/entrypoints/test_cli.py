"""`shoal serve` flags: one per `EngineArgs` field, typed from its annotation."""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing

import pytest

from shoal.cli import engine_args_from, make_parser, parse_size
from shoal.config import EngineArgs


def _parse(*argv: str) -> argparse.Namespace:
    return make_parser().parse_args(["serve", *argv])


def test_every_engine_arg_has_a_flag() -> None:
    args = _parse()
    for field in dataclasses.fields(EngineArgs):
        assert hasattr(args, field.name), field.name
    assert engine_args_from(args) == EngineArgs()  # no flags: the defaults


def test_flags_become_engine_args() -> None:
    args = _parse(
        "/models/llama",
        "--max-model-len",
        "4k",
        "--dtype",
        "bfloat16",
        "-tp",
        "2",
        "-pp",
        "2",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--load-format",
        "dummy",
        "--kv-cache-memory-bytes",
        "2GiB",
        "--pipeline-layer-partition",
        "3",
        "5",
        "--gpu-memory-utilization",
        "0.5",
        "--served-model-name",
        "llama",
    )
    engine_args = engine_args_from(args)
    assert args.model_tag == "/models/llama"
    assert engine_args.max_model_len == 4000
    assert engine_args.dtype == "bfloat16"
    assert engine_args.tensor_parallel_size == 2 and engine_args.pipeline_parallel_size == 2
    assert engine_args.enable_prefix_caching is False and engine_args.enforce_eager is True
    assert engine_args.load_format == "dummy"
    assert engine_args.kv_cache_memory_bytes == 2 * 1024**3
    assert engine_args.pipeline_layer_partition == (3, 5)
    assert engine_args.gpu_memory_utilization == 0.5
    assert engine_args.served_model_name == "llama"


def test_server_flags() -> None:
    args = _parse("--host", "0.0.0.0", "--port", "9000", "--api-key", "k", "--max-request-body-bytes", "1MiB")
    assert (args.host, args.port, args.api_key, args.max_request_body_bytes) == ("0.0.0.0", 9000, "k", 1024**2)
    defaults = _parse()
    assert (defaults.host, defaults.port, defaults.stats_interval) == ("127.0.0.1", 8000, 10.0)


def test_bad_flags_exit() -> None:
    with pytest.raises(SystemExit):
        _parse("--load-format", "pickle")
    with pytest.raises(SystemExit):
        _parse("--max-model-len", "lots")


@pytest.mark.parametrize(
    ("text", "value"), [("17", 17), ("1k", 1000), ("1K", 1000), ("2M", 2_000_000), ("1GiB", 2**30), ("1.5KiB", 1536)]
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_bad_engine_args_fail_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    from shoal.cli import main

    children = set(multiprocessing.active_children())
    with pytest.raises(SystemExit) as exc_info:
        main(["serve", "/no/such/model", "--port", "0"])
    assert exc_info.value.code == 2
    assert "not a local directory" in capsys.readouterr().err
    # The engine-core process started before the config was built; it is gone again.
    assert set(multiprocessing.active_children()) <= children


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


HELPED_COMMANDS = [("serve",), ("batch",), ("bench", "throughput"), ("bench", "latency"), ("bench", "serve")]


@pytest.mark.parametrize("command", HELPED_COMMANDS, ids=" ".join)
def test_every_flag_has_help_and_one_clear_default(command: tuple[str, ...]) -> None:
    parser = make_parser()
    for name in command:
        parser = _subparser(parser, name)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0] if action.option_strings else action.dest
        assert action.help, f"{flag} has no help"
        shown = formatter._expand_help(action)
        assert shown.count("(default") <= 1, f"{flag}: {shown}"
        assert "default: None" not in shown, f"{flag}: {shown}"
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if not switch and not action.required:
            assert "(default: " in shown, f"{flag} does not say its default: {shown}"
    assert "--help" in parser.format_help()


def test_every_tool_and_reasoning_parser_is_a_choice() -> None:
    from shoal.cli import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
    from shoal.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from shoal.entrypoints.openai.tool_parsers import TOOL_PARSERS

    assert set(TOOL_PARSER_NAMES) == set(TOOL_PARSERS)
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)
    args = _parse("--tool-call-parser", "deepseek_v3", "--enable-auto-tool-choice")
    assert args.tool_call_parser == "deepseek_v3"
