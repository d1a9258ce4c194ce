"""Bad input at the server's door (issue 20, item 4), in process on the fake engine: invalid Unicode, max_tokens
past the context, oversized bodies; and max_model_len past the checkpoint's context."""

import openai
import pytest
from fastapi.testclient import TestClient

from compiled_llm.server.app import create_app
from server_utils import FakeEngine

pytestmark = pytest.mark.timeout(60)

HI = [{"role": "user", "content": "hi"}]
SURROGATE = [  # raw JSON: "\ud800" decodes to a lone surrogate, which no tokenizer takes
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop"),
    ("/v1/completions", '{"prompt": "\\ud83d"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\ud83d"]}', "prompt"),
    ("/v1/responses", '{"input": "x\\udc00"}', "input"),
    ("/v1/responses", '{"input": "x", "instructions": "\\udc00"}', "instructions"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
]


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(FakeEngine(max_model_len=64), max_request_body_bytes=4096)) as c:
        yield c


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


@pytest.mark.parametrize("path,body,param", SURROGATE, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(SURROGATE)])
def test_lone_surrogates_are_a_400_naming_the_field(client, path, body, param):
    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert "invalid Unicode" in err["message"] and "U+D" in err["message"]
    assert "connection" not in r.headers or r.headers["connection"] != "close"
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_max_tokens_past_the_context_is_a_400(client, oai):
    prompt_len = len(client.post("/tokenize", json={"messages": HI}).json()["tokens"])
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=10**9)
    body = err.value.body
    assert body["param"] == "max_tokens"
    assert body["message"].startswith(
        f"This model's maximum context length is 64 tokens. However, you requested {10**9 + prompt_len} tokens "
        f"({prompt_len} in the messages, {10**9} in the completion).")
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="fake-model", messages=HI, max_completion_tokens=64)
    assert err.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="fake-model", prompt="x" * 40, max_tokens=30)  # 41 ids with <bos>
    assert err.value.body["param"] == "max_tokens" and "(41 in the prompt, 30 in the completion)" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="fake-model", input="hi", max_output_tokens=1000)
    assert err.value.body["param"] == "max_output_tokens" and "in the input" in err.value.message
    # exactly what is left still runs, to the end
    ok = oai.completions.create(model="fake-model", prompt="x" * 40, max_tokens=23)
    assert ok.usage.completion_tokens == 23 and ok.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:  # no room at all: the prompt is what is too long
        oai.completions.create(model="fake-model", prompt="x" * 70)
    assert err.value.body["param"] == "prompt"


def test_request_body_limit_is_a_413(client):
    big = {"prompt": "x" * 5000, "max_tokens": 1}
    r = client.post("/v1/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "4096" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while read
        for _ in range(10):
            yield b" " * 1000

    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/completions", content=iter([b'{"prompt": "ok", ', b'"max_tokens": 2}']),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_max_model_len_past_the_checkpoint_needs_the_flag(tiny_ckpt):
    from compiled_llm.config import EngineConfig
    from compiled_llm.runtime.context_len import check_max_model_len

    folder, _ = tiny_ckpt("dense")  # max_position_embeddings = 512
    check_max_model_len(EngineConfig(model=str(folder), max_model_len=512))
    with pytest.raises(ValueError, match=r"max_model_len \(2048\) is longer than this checkpoint's context "
                                         r"\(max_position_embeddings = 512\).*--allow-long-max-model-len"):
        check_max_model_len(EngineConfig(model=str(folder), max_model_len=2048))
    check_max_model_len(EngineConfig(model=str(folder), max_model_len=2048, allow_long_max_model_len=True))


def test_max_model_len_flag_on_the_command_line():
    import argparse

    from compiled_llm.config import add_engine_args, config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args(["--allow-long-max-model-len"])).allow_long_max_model_len
    assert not config_from_args(parser.parse_args([])).allow_long_max_model_len
