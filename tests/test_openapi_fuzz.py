"""Fuzz the gateway's and the worker's HTTP surface from the OpenAPI documents they serve (schemathesis).

A bounded, seeded campaign: every operation, positive and negative bodies, MAX_EXAMPLES each, no
shrinking, no stateful phase. Every response must be a non-5xx that conforms to the document (status
code, content type, body), every 4xx must be in OpenAI's error shape (Anthropic's on /v1/messages and
/v1/messages/count_tokens), and the processes must still be alive and healthy afterwards. All failures are
collected and reported together.
"""
from __future__ import annotations

import copy
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hypothesis
import orjson
import pytest
import requests
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    FailureGroup,
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.gateway.conftest import gateway_config, start_fakes, start_gateway  # noqa: F401 (fixtures)
from tests.support.fake_upstream import REPO_ROOT, FakeUpstream
from tests.support.gateway_proc import GatewayProcess
from tests.support.worker_proc import worker_process

MAX_EXAMPLES = 30        # per operation and generation mode
MAX_NEW_TOKENS = 4       # the worker's campaign caps max_tokens so that each example takes milliseconds
REQUEST_TIMEOUT_S = 30.0
API_KEY = "sk-fuzz-secret"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@dataclass
class Campaign:
    """What one run sent and what went wrong (each failure: operation, request, status, body, why)."""
    num_calls: int = 0
    failures: list[str] = field(default_factory=list)

    def report(self) -> str:
        return f"{len(self.failures)} failures in {self.num_calls} calls:\n" + "\n\n".join(self.failures[:20])


def fetch_json(url: str, headers: dict[str, str] | None = None) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as response:
        assert response.status == 200
        return orjson.loads(response.read())


def pin(document: dict[str, Any], schema_name: str, **overrides: Any) -> None:
    """Narrow one component schema in the fuzzer's copy (never in the served document)."""
    document["components"]["schemas"][schema_name].update(overrides)


def run_campaign(document: dict[str, Any], base_url: str, headers: dict[str, str]) -> Campaign:
    schema = schemathesis.openapi.from_dict(document)
    campaign = Campaign()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in GenerationMode:
            if mode is GenerationMode.NEGATIVE and not _has_inputs(operation):
                continue  # nothing in the request can be made invalid
            _fuzz(operation, mode, base_url, headers, session, campaign)
    return campaign


def _has_inputs(operation: schemathesis.APIOperation) -> bool:
    """A body or a parameter outside the path: a path segment is a string whatever the schema, so one alone
    (GET /v1/models/{model}) has nothing the fuzzer can make invalid."""
    definition = operation.definition.raw
    return bool(definition.get("requestBody")) or any(p.get("in") != "path" for p in definition.get("parameters", ()))


def _fuzz(operation: schemathesis.APIOperation, mode: GenerationMode, base_url: str, headers: dict[str, str],
          session: requests.Session, campaign: Campaign) -> None:
    @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def one(case: schemathesis.Case) -> None:
        campaign.num_calls += 1
        response = case.call(base_url=base_url, session=session, headers=headers, timeout=REQUEST_TIMEOUT_S)
        problems = []
        try:
            case.validate_response(response, checks=CHECKS, headers=headers)
        except FailureGroup as group:
            problems.extend(str(exc) for exc in group.exceptions)
        if 400 <= response.status_code < 600:
            anthropic = operation.path.startswith("/v1/messages")
            problems.extend(_anthropic_error_problems(response) if anthropic else _error_shape_problems(response))
        if problems:
            request = response.request
            body = request.body.decode(errors="replace") if isinstance(request.body, bytes) else request.body
            campaign.failures.append(
                f"{operation.label} [{mode.value}] {request.method} {request.url}\n  body: {str(body)[:500]}\n"
                f"  -> {response.status_code} {response.text[:500]}\n  " + "\n  ".join(problems))

    one()


def _error_shape_problems(response: schemathesis.Response) -> list[str]:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return ["error response is not JSON with an 'error' object"]
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"error object has keys {sorted(error) if isinstance(error, dict) else error!r}, "
                "expected exactly message, type, param, code"]
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return ["error message and type must be strings"]
    return []


def _anthropic_error_problems(response: schemathesis.Response) -> list[str]:
    try:
        body = response.json()
        error = body["error"]
    except (ValueError, KeyError, TypeError):
        return ["error response is not JSON with an 'error' object"]
    if body.get("type") != "error" or not isinstance(error, dict) or set(error) != {"type", "message"}:
        return [f"not Anthropic's error shape {{'type': 'error', 'error': {{'type', 'message'}}}}: {body!r}"]
    if not isinstance(error["message"], str) or not isinstance(error["type"], str):
        return ["error message and type must be strings"]
    return []


def assert_healthy(url: str) -> None:
    with urllib.request.urlopen(url + "/health", timeout=10) as response:
        assert response.status == 200


def test_gateway_surface(start_fakes: Callable[..., list[FakeUpstream]],  # noqa: F811
                         start_gateway: Callable[..., GatewayProcess]) -> None:  # noqa: F811
    fakes = start_fakes("a", "b")
    config = gateway_config({"a": [fakes[0].url], "b": [fakes[1].url]},
                            api_keys=[{"key_id": "fuzz", "key": API_KEY, "admin": True}])
    gateway = start_gateway(config)
    served = fetch_json(gateway.url + "/openapi.json", {"Authorization": f"Bearer {API_KEY}"})
    assert served == yaml.safe_load((REPO_ROOT / "docs/openapi/gateway.yaml").read_text())
    document = copy.deepcopy(served)
    # The configured model, so that valid bodies reach routing and the upstreams; negative cases still
    # send other names and types.
    pin(document, "ModelName", enum=["m"])

    started_s = time.monotonic()
    campaign = run_campaign(document, gateway.url, {"Authorization": f"Bearer {API_KEY}"})
    elapsed_s = time.monotonic() - started_s

    assert gateway.alive, gateway.log()
    assert_healthy(gateway.url)
    assert not campaign.failures, campaign.report() + "\n\ngateway log:\n" + gateway.log()[-5000:]
    assert campaign.num_calls >= MAX_EXAMPLES, campaign.num_calls
    print(f"gateway: {campaign.num_calls} calls in {elapsed_s:.1f} s")


@pytest.mark.slow
def test_worker_surface(tmp_path: Path) -> None:
    with worker_process(["--max-model-len", "128", "--max-num-seqs", "4"], log_dir=tmp_path) as url:
        served = fetch_json(url + "/openapi.json")
        assert served == yaml.safe_load((REPO_ROOT / "docs/openapi/worker.yaml").read_text())
        names = [model["id"] for model in fetch_json(url + "/v1/models")["data"]]
        document = copy.deepcopy(served)
        pin(document, "ModelName", enum=names)
        # Few new tokens, always asked for: without max_tokens a completion gets 16 and a chat fills the
        # 128-token context, seconds each on a shared CPU.
        schemas = document["components"]["schemas"]
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            request = schemas[name]["allOf"][1]
            request["required"] = [*request["required"], "max_tokens"]
            for field_name in ("max_tokens", "max_completion_tokens"):
                if field_name in request["properties"]:
                    request["properties"][field_name]["maximum"] = MAX_NEW_TOKENS
        schemas["SamplingFields"]["properties"]["min_tokens"]["maximum"] = MAX_NEW_TOKENS

        started_s = time.monotonic()
        campaign = run_campaign(document, url, {})
        elapsed_s = time.monotonic() - started_s

        assert_healthy(url)
        assert not campaign.failures, campaign.report()
        print(f"worker: {campaign.num_calls} calls in {elapsed_s:.1f} s")
