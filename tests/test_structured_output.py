"""Structured output (issue 20, item 2): response_format json_object / json_schema and the Responses API's
text.format, enforced while decoding with xgrammar. A tiny random-weight checkpoint writes garbage when free, so
output that parses and validates against the schema, ended by the grammar ("stop", not "length"), shows the mask
at work. The engine and the LLM API first, then the official client against the app in process."""

import json
import sys

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from compiled_llm import LLM, SamplingParams
from compiled_llm.runtime import structured_output as so
from compiled_llm.runtime.async_scheduling import needs_host_history
from compiled_llm.runtime.errors import StructuredOutputError

xgr = pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
          "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}
SIZE = {"type": "object", "additionalProperties": False, "required": ["size"],
        "properties": {"size": {"enum": ["S", "M", "L"]}}}
PROMPTS = ["The quick brown fox", "Once upon a time", "A paged KV cache"]
MAX = 60  # tokens; the tiny model completes these schemas in about 30


def validate(obj, schema) -> None:
    try:
        import jsonschema_rs

        jsonschema_rs.validate(schema, obj)
    except ImportError:
        try:
            import jsonschema

            jsonschema.validate(obj, schema)
        except ImportError:  # by hand: this file's schemas are flat objects of enums and booleans
            assert isinstance(obj, dict) and set(obj) == set(schema["required"])
            for k, v in obj.items():
                spec = schema["properties"][k]
                assert v in spec["enum"] if "enum" in spec else isinstance(v, bool)


def check_json(text: str, schema=None):
    obj = json.loads(text)
    assert isinstance(obj, dict)
    if schema is not None:
        validate(obj, schema)
    return obj


def engine_kw(**kw):
    return dict(enforce_eager=True, block_size=4, max_model_len=128, **kw)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return str(tiny_ckpt("dense")[0])


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, **engine_kw())


def greedy(**kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX, **kw})


# ------------------------------------------------------------------ engine and LLM API
def test_sampling_params_validation():
    assert SamplingParams(structured_output={"json": json.dumps(SIZE)}).structured_output == {"json": SIZE}
    assert needs_host_history(SamplingParams(structured_output={"json_object": True}))
    for bad in ({"json": SIZE, "json_object": True}, {"regexp": "a"}, {"json_object": False}, {"json": "{nope"},
                {"json": [1]}, "json"):
        with pytest.raises(ValueError, match="^structured_output"):
            SamplingParams(structured_output=bad)


def test_regex_choice_and_grammar_constraints(llm):
    """vLLM's other constraints: a regular expression, a choice of strings, an EBNF grammar. The tiny random model
    writes none of these free; constrained, each output matches and is ended by the grammar. Bad ones are
    refused at construction or, where only xgrammar can tell, at admission (the engine keeps serving)."""
    import re

    choices = ["red", 'say "hi"', "a\\b"]  # quotes and a backslash survive the grammar's string literals
    params = [greedy(structured_output={"regex": r"[0-9]{3}-[a-z]{2}"}),
              greedy(structured_output={"choice": choices}),
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX, structured_output={"choice": choices}),
              greedy(structured_output={"grammar": 'root ::= ("yes" | "no") ", " [0-9] [0-9]'})]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], params)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0].outputs[0].text)
    assert [c.text in choices for c in (*outs[1].outputs, *outs[2].outputs)] == [True] * 4
    assert re.fullmatch(r"(yes|no), [0-9]{2}", outs[3].outputs[0].text)
    assert all(c.finish_reason == "stop" for o in outs for c in o.outputs)
    free = llm.generate(PROMPTS[0], greedy(max_tokens=8))[0].outputs[0].text
    assert not re.fullmatch(r"[0-9]{3}-[a-z]{2}", free)
    for bad in ({"choice": []}, {"choice": ["a", 3]}, {"regex": ""}, {"grammar": 5}, {"regex": "a", "choice": ["a"]}):
        with pytest.raises(ValueError, match="^structured_output"):
            SamplingParams(structured_output=bad)
    with pytest.raises(StructuredOutputError, match="invalid regular expression"):
        llm.generate("hi", greedy(structured_output={"regex": "(unclosed"}))
    with pytest.raises(StructuredOutputError, match="invalid EBNF grammar"):
        llm.generate("hi", greedy(structured_output={"grammar": "root ::= "}))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[1], params[1])[0].outputs[0].text == outs[1].outputs[0].text


def test_constrained_batched_with_unconstrained(llm):
    """Constrained rows (greedy and seeded random, json_schema and json_object) in one batch with free ones: the
    constrained ones validate and end by the grammar; the free ones give the tokens they give alone."""
    free = greedy(ignore_eos=True, max_tokens=12)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free)]
    params = [greedy(structured_output={"json": SCHEMA}), free,
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=MAX, structured_output={"json": SIZE}),
              free, greedy(structured_output={"json_object": True})]
    outs = llm.generate([PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[2]], params)
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
    schemas = [SCHEMA, SIZE, SIZE, None]
    constrained = [outs[0].outputs[0], *outs[2].outputs, outs[4].outputs[0]]
    for c, schema in zip(constrained, schemas):
        assert c.finish_reason == "stop", c
        check_json(c.text, schema)
    assert llm.engine.block_manager.usage() == 0.0
    # the compiled grammars are cached by (kind, schema): the same schema again compiles nothing
    misses = llm.engine.grammars.misses
    again = llm.generate(PROMPTS[0], greedy(structured_output={"json": dict(reversed(list(SCHEMA.items())))}))
    assert again[0].outputs[0].text == outs[0].outputs[0].text and llm.engine.grammars.misses == misses


def test_grammar_waits_for_its_after_token(llm):
    """after_token_id (a thinking model's end of reasoning): the tokens up to that one are the free model's, and
    the grammar holds from the next one."""
    assert SamplingParams(structured_output={"json_object": True, "after_token_id": 5}).structured_output == {
        "json_object": True, "after_token_id": 5}
    with pytest.raises(ValueError, match="after_token_id"):
        SamplingParams(structured_output={"json_object": True, "after_token_id": -1})
    free = llm.generate(PROMPTS[0], greedy(ignore_eos=True, max_tokens=6))[0].outputs[0].token_ids
    k = free.index(free[-1])  # the trigger's first place in the free output
    out = llm.generate(PROMPTS[0], greedy(structured_output={"json": SCHEMA, "after_token_id": free[-1]}))[0].outputs[0]
    assert k > 0 and out.token_ids[:k + 1] == free[:k + 1] and out.finish_reason == "stop"
    check_json(llm.engine.tokenizer.decode(out.token_ids[k + 1:], skip_special_tokens=True), SCHEMA)


def test_mask_applied_on_the_logits_device_in_one_call(llm, monkeypatch):
    """The fast path: each step fills one packed bitmask for the batch and xgrammar's kernel applies it to the
    logits where they are, for the constrained rows only; the torch fallback is not used."""
    calls = []
    kernel = xgr.apply_token_bitmask_inplace

    def spy(logits, bitmask, **kw):
        calls.append((logits.device, bitmask.device, tuple(logits.shape), tuple(bitmask.shape), kw.get("indices")))
        return kernel(logits, bitmask, **kw)

    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace", spy)
    monkeypatch.setattr(so, "apply_bitmask_torch", lambda *a: pytest.fail("the torch fallback ran"))
    outs = llm.generate(PROMPTS[:2], [greedy(structured_output={"json": SIZE}), greedy(ignore_eos=True, max_tokens=4)])
    check_json(outs[0].outputs[0].text, SIZE)
    vocab = llm.engine.executor.model_config.vocab_size
    assert len(calls) == len(outs[0].outputs[0].token_ids)  # one call per step of the constrained row
    dev, mdev, lshape, mshape, idx = calls[0]
    assert dev == mdev == llm.engine.executor.device
    assert lshape == (2, vocab) and mshape == (2, (vocab + 31) // 32) and idx == [0]


def test_torch_unpack_matches_the_kernel():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 3), dtype=torch.int32)
    a, b = logits.clone(), logits.clone()
    xgr.apply_token_bitmask_inplace(a, bitmask, vocab_size=70)
    so.apply_bitmask_torch(b, bitmask)
    assert torch.equal(a, b) and torch.isinf(b).any()


def test_invalid_schema_and_missing_library(llm, monkeypatch):
    with pytest.raises(StructuredOutputError, match="invalid JSON schema: .*frobnicate"):
        llm.generate("hi", greedy(structured_output={"json": {"type": "frobnicate"}}))
    assert not llm.engine.has_unfinished_requests()
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    backend = so.GrammarBackend(llm.get_tokenizer(), 300, [1])
    with pytest.raises(ValueError, match="needs the `xgrammar` package"):
        backend.compile({"json": SIZE})


def test_prepared_grammar_is_a_cache_hit_and_lookups_never_wait_for_a_compile(llm, monkeypatch):
    """The server compiles a request's grammar in a worker thread (LLMEngine.prepare_structured_output); the
    engine thread's admission then hits the cache, and a lookup does not wait for another schema's compile."""
    import threading

    engine = llm.engine
    engine.prepare_structured_output({"json": SIZE})
    hits = engine.grammars.hits
    out = llm.generate("hi", greedy(structured_output={"json": SIZE}))
    assert engine.grammars.hits == hits + 1 and check_json(out[0].outputs[0].text, SIZE)
    compiler = engine.grammars._get_compiler()
    started, release = threading.Event(), threading.Event()

    class Slow:  # a compile that holds until released
        def compile_json_schema(self, text, **kw):
            started.set()
            release.wait(10)
            return compiler.compile_json_schema(text, **kw)

    monkeypatch.setattr(engine.grammars, "_get_compiler", lambda: Slow())
    fresh = {"type": "object", "properties": {"only_in_this_test": {"type": "integer"}}}  # not in the cache
    worker = threading.Thread(target=engine.prepare_structured_output, args=({"json": fresh},))
    worker.start()
    try:
        assert started.wait(10)
        out = llm.generate("hi", greedy(structured_output={"json": SIZE}))  # meanwhile: served from the cache
        assert check_json(out[0].outputs[0].text, SIZE) and worker.is_alive()
    finally:
        release.set()
        worker.join(10)
    assert engine.grammars.compile({"json": fresh}) is engine.grammars.compile({"json": fresh})  # compiled once


def test_async_scheduling_steps_constrained_requests_synchronously(ckpt, llm):
    fast = LLM(ckpt, **engine_kw(async_scheduling=True))
    params = [greedy(ignore_eos=True, max_tokens=10), greedy(structured_output={"json": SCHEMA})]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    assert [o.outputs[0].token_ids for o in fast.generate(PROMPTS[:2], params)] == want
    assert fast.engine.sync_steps > 0 and fast.engine.block_manager.usage() == 0.0
    steps = fast.engine.async_steps
    fast.generate(PROMPTS[0], params[0])  # once no grammar runs, steps overlap again
    assert fast.engine.async_steps > steps


# ------------------------------------------------------------------ server, official client
@pytest.fixture(scope="module")
def oai(llm):
    from compiled_llm.server.app import create_app

    with TestClient(create_app(llm.engine, served_model_names=["tiny"])) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


MSG = [{"role": "user", "content": "Pick a color."}]
FMT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}


def test_chat_json_schema_and_json_object(oai):
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0, response_format=FMT)
    assert r.choices[0].finish_reason == "stop"
    check_json(r.choices[0].message.content, SCHEMA)
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0,
                                    response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    check_json(r.choices[0].message.content)
    chunks = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0, stream=True,
                                         response_format=FMT)
    parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason) for c in chunks if c.choices]
    assert parts[-1][1] == "stop"
    check_json("".join(p for p, _ in parts), SCHEMA)


def test_completions_and_responses(oai):
    r = oai.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=MAX, temperature=0,
                               extra_body={"response_format": {"type": "json_schema",
                                                               "json_schema": {"name": "s", "schema": SIZE}}})
    for c in r.choices:
        assert c.finish_reason == "stop"
        check_json(c.text, SIZE)
    fmt = {"type": "json_schema", "name": "pick", "schema": SCHEMA, "strict": True}
    resp = oai.responses.create(model="tiny", input="Pick a color.", max_output_tokens=MAX, temperature=0,
                                text={"format": fmt})
    assert resp.status == "completed" and resp.text.format.type == "json_schema"
    check_json(resp.output_text, SCHEMA)


def test_vllm_structured_outputs_and_guided_fields(oai):
    """vLLM's request fields, through the official client's extra_body: structured_outputs (one of json, regex,
    choice, grammar, json_object) and the older guided_json / guided_regex / guided_choice / guided_grammar."""
    import re

    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0,
                                    extra_body={"structured_outputs": {"json": json.dumps(SCHEMA)}})
    check_json(r.choices[0].message.content, SCHEMA)
    r = oai.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=MAX, temperature=0,
                               extra_body={"guided_regex": r"[A-Z][a-z]{2} [0-9]"})
    assert [bool(re.fullmatch(r"[A-Z][a-z]{2} [0-9]", c.text)) for c in r.choices] == [True, True]
    r = oai.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX, temperature=0,
                               extra_body={"guided_choice": ["yes", "no"], "guided_decoding_backend": "xgrammar"})
    assert r.choices[0].text in ("yes", "no")
    chunks = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0, stream=True,
                                         extra_body={"guided_grammar": 'root ::= "ab" [0-9] [0-9]'})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(r"ab[0-9]{2}", text)
    r = oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=MAX, temperature=0,
                                    extra_body={"guided_json": SIZE})
    check_json(r.choices[0].message.content, SIZE)


def test_bad_constraint_fields_are_400_naming_the_field(oai, monkeypatch):
    def refused(**extra):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, **extra)
        return err.value.body["param"], err.value.message

    param, msg = refused(response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert param == "guided_regex" and "one structured-output constraint" in msg
    param, msg = refused(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert param == "structured_outputs" and "exactly one of" in msg
    assert refused(extra_body={"structured_outputs": {}})[0] == "structured_outputs"
    param, msg = refused(extra_body={"guided_regex": "(unclosed"})
    assert param == "guided_regex" and "invalid regular expression" in msg
    param, msg = refused(extra_body={"guided_choice": []})
    assert param == "guided_choice" and "non-empty list" in msg
    param, msg = refused(extra_body={"guided_json": "{nope"})
    assert param == "guided_json" and "not valid JSON" in msg
    param, msg = refused(extra_body={"structured_outputs": {"regex": "a", "whitespace_pattern": " "}})
    assert param == "structured_outputs" and "whitespace_pattern" in msg  # an unknown sub-field: named, not dropped
    from compiled_llm.server import structured_output as server_so

    monkeypatch.setattr(server_so, "grammar_library_installed", lambda: False)
    param, msg = refused(extra_body={"guided_choice": ["a", "b"]})
    assert param == "guided_choice" and "`xgrammar`" in msg


def test_bad_requests_are_400_naming_the_field(oai, monkeypatch):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                         "properties": {"a": {"type": "frob"}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, response_format=bad)
    assert err.value.body["param"] == "response_format" and "invalid JSON schema" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=4,
                                    response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert err.value.body["param"] == "response_format" and "json_schema.schema is required" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="tiny", input="hi", max_output_tokens=4,
                             text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}})
    assert err.value.body["param"] == "text"
    from compiled_llm.server import structured_output as server_so

    monkeypatch.setattr(server_so, "grammar_library_installed", lambda: False)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, response_format={"type": "json_object"})
    assert err.value.body["param"] == "response_format" and "`xgrammar`" in err.value.message
