"""Tool calling (issue 20, item 1): the parsers on text, then the official client against the app on the fake
engine, whose scripted answers stand in for a model that writes calls, and the real demo checkpoint for the
prompt the template renders with tools and a forced call."""

import json

import openai
import pytest
from fastapi.testclient import TestClient

from compiled_llm.sampling_params import SamplingParams
from compiled_llm.server.app import create_app
from compiled_llm.server.tool_parsers import CallEvent, ContentEvent, ToolCallStream
from compiled_llm.server.tool_parsers.gemma4 import Gemma4ToolParser, parse_gemma_value
from compiled_llm.server.tool_parsers.qwen import QwenToolParser
from server_utils import FakeServers
from tool_templates import GEMMA4, QWEN_THINKING, QWEN_XML

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
QWEN_CALL = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
GEMMA_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris, {FR}<|"|>,days:3}<tool_call|>'


def run_stream(parser, text, tools=(WEATHER,), prefix="", step=1):
    s = ToolCallStream(parser, list(tools), prefix)
    events = []
    for i in range(0, len(text), step):
        events += s.feed(text[i:i + step])
    return events + s.finish()


def summary(events):
    content = "".join(e.text for e in events if isinstance(e, ContentEvent))
    return content, [(e.index, e.name, json.loads(e.arguments)) for e in events if isinstance(e, CallEvent)]


# ------------------------------------------------------------------ parsers on text
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_qwen_xml_and_json_calls(step):
    p = QwenToolParser(QWEN_XML)
    assert p.xml
    assert summary(run_stream(p, QWEN_CALL, step=step)) == (
        "Let me check.", [(0, "get_weather", {"city": "Paris", "days": 3})])
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert summary(run_stream(p, two, (WEATHER, TIME), step=step)) == (
        "", [(0, "get_weather", {"city": "Oslo"}), (1, "get_time", {})])
    # a "<" that does not open a call is content, and a call that does not parse comes back as content
    assert summary(run_stream(p, "a < b <tool_call>{not json}</tool_call> end", step=step)) == (
        "a < b <tool_call>{not json}</tool_call> end", [])
    # cut off inside a call (max_tokens): what is there is parsed if it can be
    assert summary(run_stream(p, "<tool_call>\n<function=get_weather>\n<parameter=city>\nRo", step=step)) == (
        "", [(0, "get_weather", {"city": "Ro"})])


def test_qwen_xml_values_follow_the_schema():
    p = QwenToolParser(QWEN_XML)
    body = ("<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n7\n</parameter>\n"
            "<parameter=extra>\n[1, 2]\n</parameter>\n</function>")
    assert p.parse_call(body, [WEATHER]).arguments == {"city": "42", "days": 7, "extra": [1, 2]}
    assert p.forced_prefix("get_weather") == "<tool_call>\n<function=get_weather>\n"
    assert QwenToolParser("{{ '<tool_call>' }} json").forced_prefix("f") == '<tool_call>\n{"name": "f", "arguments": '


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_gemma4_calls(step):
    p = Gemma4ToolParser()
    assert summary(run_stream(p, GEMMA_CALL, step=step)) == (
        "", [(0, "get_weather", {"city": "Paris, {FR}", "days": 3})])
    nested = ('Sure.<|tool_call>call:plan{steps:[{name:<|"|>a<|"|>,ok:true},{name:<|"|>b<|"|>,ok:false}],'
              'ratio:-0.5,note:null}<tool_call|>')
    assert summary(run_stream(p, nested, step=step)) == (
        "Sure.", [(0, "plan", {"steps": [{"name": "a", "ok": True}, {"name": "b", "ok": False}], "ratio": -0.5,
                               "note": None})])
    assert summary(run_stream(p, "<|tool_call>call:f{x:<|\"|>open}<tool_call|>", step=step))[1] == []
    with pytest.raises(ValueError):
        parse_gemma_value("{a:1,}")
    assert p.forced_prefix("get_weather") == "<|tool_call>call:get_weather{" and p.keep_special_tokens


def test_forced_prefix_is_prompt_not_content():
    p = QwenToolParser(QWEN_XML)
    rest = "<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"
    assert summary(run_stream(p, rest, prefix=p.forced_prefix("get_weather"))) == (
        "", [(0, "get_weather", {"city": "Rome"})])


# ------------------------------------------------------------------ the API, fake engine with scripted answers
@pytest.fixture()
def served():
    servers = FakeServers()
    yield lambda template=QWEN_XML, parser="qwen": servers.make(chat_template=template, tool_call_parser=parser)
    servers.close()


def test_round_trip_with_the_official_client(served):
    engine, oai = served()
    engine.scripts = [QWEN_CALL, "It is sunny in Paris."]
    first = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert '"name": "get_weather"' in engine.prompts[0] and "<tool_call>\n<function=NAME>" in engine.prompts[0]

    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    second = oai.chat.completions.create(model="fake-model", messages=history, tools=[WEATHER, TIME])
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason == "stop"
    prompt = engine.prompts[1]  # the earlier call, in the model's own format, then the tool's answer
    assert ("<|im_start|>assistant\nLet me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>") in prompt
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_streamed_tool_calls_add_up_to_the_answer(served):
    engine, oai = served()
    engine.scripts = [QWEN_CALL + "\n" + QWEN_CALL.split("\n", 1)[1].replace("Paris", "Lyon"), QWEN_CALL]
    chunks = list(oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check."
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)["city"]) for tc in calls] == [
        (0, "get_weather", "Paris"), (1, "get_weather", "Lyon")]
    assert len({tc.id for tc in calls}) == 2
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # parallel_tool_calls=false: the first call only
    one = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1


def test_forced_calls_under_a_grammar(served):
    """tool_choice "required" or a named function, with xgrammar: the answer is JSON under the schema's grammar
    (the named function's arguments, or a list of {name, parameters}), streamed or not."""
    engine, oai = served()
    engine.scripts = ['{"city": "Rome"}', '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                      '"parameters": {"city": "Oslo"}}]', '{"city": "Rome"}', '{"city": "Ro']
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    assert engine.prompts[0].endswith("<|im_start|>assistant\n")  # nothing appended: the grammar forces the call
    assert engine.params[0].structured_output == {"json": WEATHER["function"]["parameters"]}
    (call,) = out.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"

    req = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    schema = engine.params[1].structured_output["json"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [b["properties"]["name"]["const"] for b in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in req.choices[0].message.tool_calls] == [
        ("get_time", {}), ("get_weather", {"city": "Oslo"})]

    calls = []
    for chunk in oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER], tool_choice=named,
                                             stream=True):
        calls += chunk.choices[0].delta.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    # cut by max_tokens before the JSON closed: given back as content, never dropped
    cut = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER], tool_choice=named,
                                      max_tokens=8)
    assert cut.choices[0].message.content == '{"city":' and cut.choices[0].finish_reason == "length"
    oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                parallel_tool_calls=False)
    assert engine.params[-1].structured_output["json"]["maxItems"] == 1


def test_tool_choice_without_the_grammar_library(served, monkeypatch):
    """Without xgrammar a forced call is the format's opening appended to the prompt."""
    from compiled_llm.server import tools

    monkeypatch.setattr(tools, "grammar_library_installed", lambda: False)
    engine, oai = served()
    engine.scripts = ["<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>", "plain answer",
                      "get_time>\n</function>\n</tool_call>"]
    named = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.prompts[0].endswith("<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n")
    (call,) = named.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    none = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in engine.prompts[1] and none.choices[0].message.content == "plain answer"
    required = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER, TIME],
                                           tool_choice="required")
    assert engine.prompts[2].endswith("<tool_call>\n<function=")
    assert required.choices[0].message.tool_calls[0].function.name == "get_time"
    assert required.choices[0].finish_reason == "tool_calls"


def test_gemma4_format_end_to_end(served):
    engine, oai = served(GEMMA4, "gemma4")
    engine.scripts = [GEMMA_CALL]
    out = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER])
    (call,) = out.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris, {FR}", "days": 3}
    assert out.choices[0].message.content is None and out.choices[0].finish_reason == "tool_calls"
    params = engine.params[0]  # the call markers are special tokens of the real vocabulary
    assert params.skip_special_tokens is False and "<|tool_response>" in params.stop
    assert '<|tool>declaration:get_weather{"properties"' in engine.prompts[0]
    engine.scripts = ["Sunny."]
    history = ASK + [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    oai.chat.completions.create(model="fake-model", messages=history, tools=[WEATHER])
    assert ('<|tool_call>call:get_weather{city:<|"|>Paris, {FR}<|"|>,days:3}<tool_call|><turn|>'
            in engine.prompts[1])
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}' in engine.prompts[1]


def test_tool_request_errors(served):
    engine, oai = served()
    bad = [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="auto"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
        (dict(messages=ASK + [{"role": "tool", "content": "x"}]), "messages"),
        (dict(messages=ASK + [{"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]),
         "messages"),
    ]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="fake-model", **{"messages": ASK, **kw})
        assert err.value.body["param"] == param, (kw, err.value.body)
    _, plain = served(None, None)  # no template that renders tools
    with pytest.raises(openai.BadRequestError, match="does not render tools"):
        plain.chat.completions.create(model="fake-model", messages=ASK, tools=[WEATHER])


# ------------------------------------------------------------------ the real checkpoint renders tools
def test_real_checkpoint_renders_tools_and_the_forced_call():
    from compiled_llm import LLM

    llm = LLM(max_model_len=512, num_kv_blocks=64, dtype="float32", enforce_eager=True, block_size=16)
    eng = llm.engine
    with TestClient(create_app(eng, chat_template=GEMMA4)) as client:  # the demo model: gemma4_text
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client, max_retries=0)
        rendered = eng.input_processor.apply_chat_template(ASK, chat_template=GEMMA4, tools=[WEATHER])
        assert "<|tool>declaration:get_weather" in rendered
        ids = eng.tokenize(rendered, add_special_tokens=False)
        tok = client.post("/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()
        assert tok["tokens"] == ids
        # a forced call on the real engine: the random model's answer is held to the arguments' grammar (a schema
        # of enums, so it ends within a few tokens), and comes back as a call whose arguments follow it
        unit = {"type": "function", "function": {"name": "set_unit", "parameters": {
            "type": "object", "properties": {"unit": {"enum": ["celsius", "kelvin"]}, "fast": {"type": "boolean"}},
            "required": ["unit", "fast"], "additionalProperties": False}}}
        out = oai.chat.completions.create(model=eng.model_name, messages=ASK, tools=[WEATHER, unit], max_tokens=40,
                                          temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "set_unit"}})
        assert out.usage.prompt_tokens == len(eng.tokenize(
            eng.input_processor.apply_chat_template(ASK, chat_template=GEMMA4, tools=[WEATHER, unit]),
            add_special_tokens=False))
        (call,) = out.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "set_unit" and args["unit"] in ("celsius", "kelvin")
        assert set(args) == {"unit", "fast"}
        assert out.choices[0].finish_reason == "tool_calls"
    # chat_template_kwargs reach the real tokenizer's template (LLM.chat as in vLLM); its own arguments are refused
    off = llm.chat(ASK, SamplingParams(max_tokens=1), chat_template=QWEN_THINKING,
                   chat_template_kwargs={"enable_thinking": False})
    assert eng.tokenizer.decode(off[0].prompt_token_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tools"):
        llm.chat(ASK, chat_template=QWEN_THINKING, chat_template_kwargs={"tools": []})
