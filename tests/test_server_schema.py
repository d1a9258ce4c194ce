"""Property-based API test: schemathesis sends requests generated from the server's own OpenAPI
schema (valid and invalid ones); none may get a 5xx. Slow: run with `pytest -m slow`."""

import os

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from compiled_llm.server.app import create_app  # noqa: E402
from server_utils import FakeEngine, ServerProcess  # noqa: E402

MODEL_PATH = os.environ.get("SERVER_TEST_MODEL")
EXAMPLES = int(os.environ.get("SCHEMA_EXAMPLES", "50"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def server():
    # A short max_model_len bounds how long any generated request can run.
    srv = ServerProcess("--max-model-len", "48", "--num-kv-blocks", "64", "--enforce-eager", "--max-num-seqs", "16",
                        *(["--model", MODEL_PATH] if MODEL_PATH else []))
    yield srv
    assert srv.terminate() == 0, srv.output()


# The schema does not depend on the engine: build it from an app around the fake engine, and send
# the generated requests to the real server.
schema = schemathesis.openapi.from_dict(create_app(FakeEngine()).openapi())


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    response = case.call(base_url=server.url, timeout=120)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.status_code}: " \
                                       f"{response.text[:500]}"
    if response.status_code >= 400 and case.path != "/health":
        body = response.json()
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_server_still_healthy_after_fuzzing(server):
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
