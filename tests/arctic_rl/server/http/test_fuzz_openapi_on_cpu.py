"""Property-based fuzzing of the reference server's JSON endpoints (schemathesis + hypothesis): no 5xx.

The server's own ``/openapi.json`` lists every path with its query and path parameters, but its
routes read raw bodies (DSSST1, ``torch.save`` or JSON by content type), so FastAPI cannot describe
the bodies. The test fills them in from the protocol's request models -- the same pydantic models
the server validates with (``JobConfig``, ``StepRequest``, ``SaveRequest``, ...) -- and narrows
``job_id`` to a small range so that the generated calls hit the live jobs (ids 1-2) as often as
unknown ones. Each operation then gets ``EXAMPLES`` generated calls, schema-valid and
schema-breaking (``GenerationMode.POSITIVE`` and ``NEGATIVE``), within a bounded wall time. Any 5xx
fails the test; the server must be healthy after each operation.
"""

from __future__ import annotations

import copy
import time
from collections import Counter

import pytest
import requests

from arctic_rl.protocol import (
    DestroyRequest,
    GenerateRequest,
    JobConfig,
    LoadCheckpointRequest,
    LogProbsRequest,
    OperationRequest,
    ResetPrefixCacheRequest,
    SaveRequest,
    StepRequest,
    V1SyncWeightsRequest,
    WeightNormRequest,
    WeightSyncRequest,
)
from tests.support.server import decode

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

pytestmark = pytest.mark.slow

EXAMPLES = 12  # per operation
BUDGET_S = 20.0  # per operation (hypothesis stops generating after it)
BODIES = {
    "/initialize": JobConfig,
    "/destroy": DestroyRequest,
    "/step": StepRequest,
    "/save": SaveRequest,
    "/save-checkpoint": SaveRequest,
    "/load-checkpoint": LoadCheckpointRequest,
    "/weight-sync": WeightSyncRequest,
    "/sync-weights": V1SyncWeightsRequest,
    "/generate": GenerateRequest,  # the v1 (JSON) form
    "/reset-prefix-cache": ResetPrefixCacheRequest,
    "/operation": OperationRequest,
    "/weight-norm": WeightNormRequest,
    "/log-probs": LogProbsRequest,
}
ORDER_LAST = ("/destroy",)  # destroys jobs: fuzz it after everything else


def with_bodies(spec: dict) -> dict:
    """The server's OpenAPI document with JSON request bodies from the protocol models."""
    spec = copy.deepcopy(spec)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, item in spec["paths"].items():
        for method, op in item.items():
            for param in op.get("parameters", []):
                if param.get("name") == "job_id":
                    param["schema"] = {"type": "integer", "minimum": -1, "maximum": 4}
            model = BODIES.get(path)
            if method != "post" or model is None:
                continue
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return spec


@pytest.fixture(scope="module")
def server(reference_server, tiny_model_dir):
    """The module's server, holding a training and a sampling job."""
    for job_type in ("training", "sampling"):
        config = {"model_name": str(tiny_model_dir), "job_type": job_type, "checkpoint_path": "fuzz"}
        decode(requests.post(reference_server.url + "/initialize", json=config, timeout=300))
    return reference_server


def test_no_server_errors_on_generated_requests(server):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode
    from schemathesis.openapi import from_dict

    spec = with_bodies(requests.get(server.url + "/openapi.json", timeout=30).json())
    assert set(BODIES) <= set(spec["paths"])
    schema = from_dict(spec)
    operations = [r.ok() for r in schema.get_all_operations()]
    operations.sort(key=lambda op: op.path in ORDER_LAST)
    tried: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    errors: list[str] = []
    started = time.monotonic()
    for operation in operations:
        deadline = time.monotonic() + BUDGET_S

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                              operation.as_strategy(GenerationMode.NEGATIVE)))
        def fuzz(case):
            if time.monotonic() > deadline:  # noqa: B023 - fuzz() runs at once, in this iteration
                return
            response = case.call(base_url=server.url, timeout=60)
            tried[operation.label] += 1  # noqa: B023
            statuses[response.status_code] += 1
            if response.status_code >= 500:
                errors.append(f"{case.method} {case.formatted_path} query={case.query} body={case.body!r}"[:500]
                              + f" -> {response.status_code}: {response.text[:300]}")

        fuzz()
        assert requests.get(server.url + "/health", timeout=10).status_code == 200, operation.label
    elapsed = time.monotonic() - started
    print(f"fuzzed {sum(tried.values())} requests over {len(tried)} operations in {elapsed:.0f} s: "
          f"statuses {dict(sorted(statuses.items()))}")
    assert not errors, "\n".join(errors)
    assert len(tried) >= len(BODIES) and sum(tried.values()) >= 5 * len(tried)
    assert any(400 <= s < 500 for s in statuses) and any(s < 300 for s in statuses)
