"""Request fields (issue 20, item 3): what the server does not implement is a 400 naming it, never dropped;
structured output reaches the engine as SamplingParams.structured_output, or is refused when the grammar library
is missing. In process, fake engine, official client."""

import openai
import pytest
from fastapi.testclient import TestClient

from compiled_llm.server.app import create_app
from server_utils import FakeEngine

pytestmark = pytest.mark.timeout(60)

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fake():
    return FakeEngine()


@pytest.fixture(scope="module")
def client(fake):
    with TestClient(create_app(fake)) as c:
        yield c


@pytest.fixture(scope="module")
def oai(client):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)


UNKNOWN = [
    ("/v1/chat/completions", {"messages": HI, "prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"messages": HI, "frobnicate": True}, "frobnicate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages.0.colour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
     "messages.0.content.0.text.x"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra"),
    ("/v1/responses", {"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ("/tokenize", {"prompt": "hi", "truncate": 3}, "truncate"),
    ("/detokenize", {"tokens": [70], "skip": True}, "skip"),
]


@pytest.mark.parametrize("path,body,where", UNKNOWN, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(UNKNOWN)])
def test_unknown_fields_are_a_400_naming_them(client, path, body, where):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == where.split(".")[0]
    assert f"unknown field `{where}`" in err["message"]


def test_unknown_field_through_the_official_client(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=2,
                                    extra_body={"guided_whitespace_pattern": " "})
    assert ("unknown field `guided_whitespace_pattern`" in err.value.message
            and err.value.body["param"] == "guided_whitespace_pattern")


def test_accepted_and_ignored_fields(oai):
    chat = oai.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi", "name": "bo"}],
                                       max_tokens=2, user="someone", response_format={"type": "text"})
    assert chat.usage.completion_tokens == 2
    comp = oai.completions.create(model="fake-model", prompt="hi", max_tokens=2, user="someone")
    assert comp.usage.completion_tokens == 2
    resp = oai.responses.create(model="fake-model", input="hi", max_output_tokens=2, user="u", store=False,
                                metadata={"k": "v"}, text={"format": {"type": "text"}})
    assert resp.metadata == {"k": "v"} and resp.usage.output_tokens == 2


def test_structured_output_reaches_the_engine(fake, oai):
    pytest.importorskip("xgrammar")  # without it the server refuses (below)
    seen = []
    for fmt, want in (({"type": "json_object"}, {"json_object": True}),
                      ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
                       {"json": {"type": "object"}})):
        oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=2, response_format=fmt)
        seen.append(want)
    oai.responses.create(model="fake-model", input="hi", max_output_tokens=2,
                         text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    seen.append({"json": {"type": "object"}})
    assert [p.structured_output for p in fake.params[-3:]] == seen
    # each grammar was compiled before the hand-over, on a thread other than the engine's
    assert [spec for spec, _ in fake.prepared[-3:]] == seen
    assert not {thread for _, thread in fake.prepared[-3:]} & fake.thread_ids


def test_structured_output_is_refused_without_the_grammar_library(oai, monkeypatch):
    from compiled_llm.server import structured_output

    monkeypatch.setattr(structured_output, "grammar_library_installed", lambda: False)
    for fmt in ({"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=2, response_format=fmt)
        assert err.value.body["param"] == "response_format"
        assert f"`{fmt['type']}` is not supported here: structured output" in err.value.message
        assert "`xgrammar`" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="fake-model", input="hi", max_output_tokens=2,
                             text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    assert err.value.body["param"] == "text" and "structured output" in err.value.message


def test_logit_bias_and_allowed_token_ids_reach_the_engine(fake, client, oai):
    oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=2, logit_bias={"70": 5, "71": -100},
                                extra_body={"allowed_token_ids": [70, 72]})
    assert (fake.params[-1].logit_bias, fake.params[-1].allowed_token_ids) == ({70: 5.0, 71: -100.0}, [70, 72])
    oai.completions.create(model="fake-model", prompt="hi", max_tokens=2, logit_bias={"70": 1.5})
    assert fake.params[-1].logit_bias == {70: 1.5}
    for body, param in (({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
                        ({"logit_bias": {"70": 101}}, "logit_bias"), ({"allowed_token_ids": [99999]},
                                                                       "allowed_token_ids")):
        r = client.post("/v1/chat/completions", json={"messages": HI, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.json())


def test_bad_words_and_truncation_reach_the_engine(fake, client, oai):
    oai.completions.create(model="fake-model", prompt="hi", max_tokens=2,
                           extra_body={"bad_words": ["spam", "eggs"], "truncate_prompt_tokens": 8})
    assert (fake.params[-1].bad_words, fake.params[-1].truncate_prompt_tokens) == (["spam", "eggs"], 8)
    for body in ({"bad_words": ["  "]}, {"bad_words": "spam"}, {"truncate_prompt_tokens": 0}):
        r = client.post("/v1/chat/completions", json={"messages": HI, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(body)), (body, r.json())


def test_priority_reaches_a_priority_engine(fake, client, oai):
    r = client.post("/v1/chat/completions", json={"messages": HI, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"  # the server schedules fcfs
    fake.config.scheduling_policy = "priority"
    try:
        oai.completions.create(model="fake-model", prompt="hi", max_tokens=2, extra_body={"priority": -2})
        oai.chat.completions.create(model="fake-model", messages=HI, max_tokens=2, extra_body={"priority": 7})
    finally:
        fake.config.scheduling_policy = "fcfs"
    assert fake.priorities[-2:] == [-2, 7]
