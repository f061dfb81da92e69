"""schemathesis over `/openapi.json` with every check it has, as `schemathesis run --checks all`
runs them (its engine: coverage, fuzzing and stateful phases): no 5xx, every status, header and
body as the schema documents them, schema-invalid bodies refused, and schema-valid ones (once
`fuzz_cases.py` has made the rules a schema cannot state hold) answered 2xx, so that the fuzzer
reaches the engine.

A dedicated tiny-model server (fast tokens, no tool parser, a context of 512), bounded in
examples per operation; `SHOAL_FUZZ_EXAMPLES` raises the count for a longer run."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.entrypoints.fuzz_cases import GENERATE_PATHS, fit_positive_body
from tests.entrypoints.server_utils import ServerProcess

schemathesis = pytest.importorskip("schemathesis")

FUZZ_MAX_MODEL_LEN = 512
MAX_EXAMPLES = int(os.environ.get("SHOAL_FUZZ_EXAMPLES", "20"))


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("fuzz_server") / "server.log"
    args = [tiny_model_path, "--max-model-len", str(FUZZ_MAX_MODEL_LEN), "--stats-interval", "0"]
    process = ServerProcess(args, log_path)
    yield process
    process.stop()


def load_schema(url: str) -> Any:
    """The served schema, every check on, positive cases fitted to the model (`fuzz_cases`)."""
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_dict(
        {"generation": {"max-examples": MAX_EXAMPLES, "deterministic": True}, "checks": {"enabled": True}}
    )
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=config)
    token_id = schema.raw_schema["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]
    vocab_size = token_id["maximum"] + 1

    @schema.hook
    def map_case(ctx: Any, case: Any) -> Any:
        if case.meta is not None and case.meta.generation.mode.is_positive and case.body is not None:
            case.body = fit_positive_body(case.operation.path, case.body, vocab_size)
        return case

    return schema


def run_all_phases(schema: Any) -> tuple[list[str], dict[str, collections.Counter[int]], set[str]]:
    """(failures, operation -> statuses answered, the checks that ran)."""
    from schemathesis.engine import events, from_schema

    failures: list[str] = []
    statuses: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    checks_run: set[str] = set()
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            for case_id, checks in event.recorder.checks.items():
                for check in checks:
                    checks_run.add(check.name)
                    if check.failure_info is not None:
                        info = check.failure_info
                        reproduce = getattr(info, "code_sample", "")  # the request, as a curl command
                        answer = event.recorder.interactions.get(case_id)
                        body = answer.response.content[:500] if answer and answer.response else b""
                        failures.append(f"{event.label}: {check.name}: {info.failure}\n{reproduce}\nanswer: {body!r}")
            for interaction in event.recorder.interactions.values():
                if interaction.response is not None:
                    statuses[event.label or ""][interaction.response.status_code] += 1
        elif isinstance(event, events.NonFatalError | events.FatalError):
            failures.append(f"{getattr(event, 'label', '')}: {event.info.format()}")
    return failures, statuses, checks_run


def test_every_operation_passes_every_check(fuzz_server: ServerProcess) -> None:
    from schemathesis.checks import CHECKS

    failures, statuses, checks_run = run_all_phases(load_schema(fuzz_server.url))
    assert not failures, "\n\n".join(failures[:10])
    assert checks_run >= {"not_a_server_error", "positive_data_acceptance", "negative_data_rejection"}
    assert checks_run >= set(CHECKS.get_all_names()) - {"max_response_time"}, checks_run  # no limit configured
    assert len(statuses) >= 10, sorted(statuses)  # every operation was called
    for path in GENERATE_PATHS:
        answered = statuses[f"POST {path}"]
        assert answered[200] >= 10, (path, dict(answered))  # valid bodies reached the engine
    assert not any(status >= 500 for answered in statuses.values() for status in answered)
