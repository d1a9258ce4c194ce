"""No request stalls the others (issue 20, item 5): a huge prompt is templated and tokenized in a preprocessing
thread, so /health and other requests answer while it runs. The demo checkpoint's real (Rust) tokenizer, the
fake engine behind it."""

import threading
import time

import pytest
from fastapi.testclient import TestClient

from compiled_llm.config import DEMO_MODEL_DIR
from compiled_llm.server.app import create_app
from server_utils import FakeEngine, FakeInputProcessor

pytestmark = pytest.mark.timeout(120)


class RealTokenizerEngine(FakeEngine):
    def __init__(self):
        super().__init__(max_model_len=256, step_delay=0.001)
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)

    def new_input_processor(self):
        import copy

        return FakeInputProcessor(copy.deepcopy(self._tok))


def test_huge_prompt_does_not_stall_health_or_other_requests():
    text = "The quick brown fox jumps over the lazy dog. " * 40000  # 1.8 MB, ~760k tokens
    with TestClient(create_app(RealTokenizerEngine())) as client:
        done = {}

        def big():
            t = time.perf_counter()
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": text}]})
            done["big"] = (r.status_code, r.json()["error"]["param"], time.perf_counter() - t)

        worker = threading.Thread(target=big)
        worker.start()
        time.sleep(0.05)
        latencies, small = [], None
        while worker.is_alive():
            t = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t)
            if small is None:  # another request is admitted and answered meanwhile
                small = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}).status_code
            time.sleep(0.01)
        worker.join()
    status, param, seconds = done["big"]
    assert (status, param) == (400, "prompt")  # far too long for the context, found once tokenized
    assert latencies and max(latencies) < 0.5, (max(latencies), seconds)
    assert small == 200
