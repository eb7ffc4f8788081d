"""schemathesis against `/openapi.json`: every operation, generated request bodies (valid and
invalid), bounded in examples (a few per operation) and in time (the model is small and the
server's max_model_len is 48, so no case generates much). Checks: no 5xx, every response conforms
to the published schema, status code and content type."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from engram_serve.engine.async_engine import AsyncLLMEngine
from engram_serve.llm import build_engine
from engram_serve.model.loader import TINY_DIR, load_model
from engram_serve.model.writer import make_random_checkpoint
from engram_serve.server.api import build_app
from engram_serve.server.run import BackgroundServer

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    path = None if (TINY_DIR / "model.safetensors").is_file() else \
        make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=1)
    engine = AsyncLLMEngine(build_engine(load_model(path), max_model_len=48, num_blocks=256, max_num_seqs=16))
    server = BackgroundServer(build_app(engine, "engram-schema", max_body_bytes=256 * 1024)).start()
    yield server.base_url
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_dict(httpx.get(base_url + "/openapi.json").json())


def test_openapi_conformance(api_schema, base_url):
    """Each operation in turn, with its own bounded hypothesis run (valid and invalid bodies)."""
    operations = [r.ok() for r in api_schema.get_all_operations()]
    assert len(operations) >= 9
    for op in operations:
        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE) |
               op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=30 if op.method.upper() == "POST" else 4, deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        def run(case):
            case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=60)

        run()
