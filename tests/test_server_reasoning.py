"""Reasoning output (--reasoning-parser, server/reasoning.py): the split of a thinking model's text into reasoning
and content, streamed and not; chat_template_kwargs reaching the template; earlier reasoning fed back; reasoning
tokens in the usage; the Responses API's reasoning item; structured output that starts after the reasoning. The
API tests run the official client on the fake engine, whose `scripts` make "the model" write given text (one
character, one token per step)."""

from __future__ import annotations

import json

import openai
import pytest
from server_utils import FakeEngine, FakeServers
from tool_templates import GEMMA4_THINKING, QWEN_THINKING

from compiled_llm.sampling_params import SamplingParams
from compiled_llm.server.app import create_app
from compiled_llm.server.errors import APIError
from compiled_llm.server.reasoning import (
    PARSERS,
    ReasoningSetup,
    ReasoningStream,
    grammar_after_reasoning,
    split_reasoning,
)

QWEN, GEMMA = PARSERS["qwen3"], PARSERS["gemma4"]
ASK = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "The user adds two and two.\nThat is 4."
QWEN_ANSWER = THOUGHT + "\n</think>\n\nIt is 4."  # the prompt opened <think>


def streamed(parser, text, in_reasoning, step):
    s = ReasoningStream(parser, in_reasoning)
    pieces = []
    for i in range(0, len(text), step):
        pieces += s.feed(text[i:i + step])
    pieces += s.finish()
    return ("".join(t for k, t in pieces if k == "reasoning") or None,
            "".join(t for k, t in pieces if k == "content") or None)


@pytest.mark.parametrize("parser,text,in_reasoning,expected", [
    (QWEN, QWEN_ANSWER, True, (THOUGHT, "It is 4.")),
    (QWEN, "<think>\n" + QWEN_ANSWER, False, (THOUGHT, "It is 4.")),  # a template that lets the model open it
    (QWEN, "  It is 4. <think>no</think>", False, (None, "It is 4. <think>no</think>")),  # only at the start
    (QWEN, "cut off while thin", True, ("cut off while thin", None)),  # max_tokens inside the block
    (GEMMA, "<|channel>thought\n" + THOUGHT + "<channel|>It is 4.", False, (THOUGHT, "It is 4.")),
    (GEMMA, "<|channel>thought\n<channel|>It is 4.", False, (None, "It is 4.")),  # an empty block
    (GEMMA, "<|channel", False, (None, "<|channel")),  # a partial marker at the end is content after all
])
def test_split_streamed_at_every_chunk_size_equals_the_whole(parser, text, in_reasoning, expected):
    whole = split_reasoning(parser, text, in_reasoning)
    assert (whole.reasoning, whole.content) == expected
    for step in (1, 2, 3, 7, len(text)):
        assert streamed(parser, text, in_reasoning, step) == expected, step


def test_where_the_output_starts_is_read_from_the_prompt():
    assert QWEN.opens_in("<|im_start|>assistant\n<think>\n")
    assert not QWEN.opens_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN.opens_in("<think>\nold\n</think>\n\nanswer<|im_end|>\n<|im_start|>assistant\n")
    assert not GEMMA.opens_in("<|turn>system\n<|think|><turn|>\n<|turn>model\n")


# ------------------------------------------------------------------ the API, fake engine with scripted answers
@pytest.fixture()
def served():
    servers = FakeServers()
    yield lambda template=QWEN_THINKING, parser="qwen3", tool_parser=None: servers.make(
        chat_template=template, reasoning_parser=parser, tool_call_parser=tool_parser)
    servers.close()


def test_chat_reasoning_content_usage_and_thinking_off(served):
    engine, oai = served()
    engine.scripts = [QWEN_ANSWER]
    out = oai.chat.completions.create(model="fake-model", messages=ASK)
    msg = out.choices[0].message
    assert engine.prompts[0].endswith("<|im_start|>assistant\n<think>\n")
    assert (msg.content, msg.model_extra["reasoning"], msg.model_extra["reasoning_content"]) == (
        "It is 4.", THOUGHT, THOUGHT)
    # one token a character: the reasoning's tokens are those up to and including </think>
    assert out.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT + "\n</think>")
    assert out.usage.completion_tokens == len(QWEN_ANSWER)

    engine.scripts = ["It is 4."]
    off = oai.chat.completions.create(model="fake-model", messages=ASK,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.prompts[1].endswith("<think>\n\n</think>\n\n")
    assert off.choices[0].message.content == "It is 4." and off.choices[0].message.model_extra["reasoning"] is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    tok = oai._client.post("http://testserver/tokenize", json={
        "messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert "".join(chr(t - 3) for t in tok["tokens"]) == engine.prompts[1]

    # the answer fed back: its reasoning reaches the template (Qwen's reads reasoning_content)
    engine.scripts = ["Yes."]
    history = ASK + [msg.model_dump(exclude_none=True), {"role": "user", "content": "Sure?"}]
    oai.chat.completions.create(model="fake-model", messages=history)
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\nIt is 4.<|im_end|>" in engine.prompts[2]

    engine.scripts = [QWEN_ANSWER]
    hidden = oai.chat.completions.create(model="fake-model", messages=ASK, extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.content == "It is 4." and hidden.choices[0].message.model_extra["reasoning"] is None


def test_streamed_reasoning_adds_up_to_the_answer(served):
    engine, oai = served()
    engine.scripts = [QWEN_ANSWER]
    reasoning, content, usage = "", "", None
    for chunk in oai.chat.completions.create(model="fake-model", messages=ASK, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            assert not (extra.get("reasoning") and c.delta.content), "one kind per delta"
            if extra.get("reasoning"):
                assert not content, "reasoning after content"
                reasoning += extra["reasoning"]
            content += c.delta.content or ""
    assert (reasoning, content) == (THOUGHT, "It is 4.")
    assert usage.completion_tokens_details.reasoning_tokens == len(THOUGHT + "\n</think>")


def test_reasoning_then_a_tool_call(served):
    engine, oai = served(QWEN_THINKING.replace("{%- for m", "{{ tools | tojson if tools else '' }}{%- for m"),
                         tool_parser="qwen")
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    engine.scripts = ["I should look it up.\n</think>\n\n" + call] * 2
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    out = oai.chat.completions.create(model="fake-model", messages=ASK, tools=[weather])
    msg = out.choices[0].message
    assert msg.model_extra["reasoning"] == "I should look it up." and msg.content is None
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert out.choices[0].finish_reason == "tool_calls"
    calls, reasoning = [], ""
    for chunk in oai.chat.completions.create(model="fake-model", messages=ASK, tools=[weather], stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning") or ""
            calls += c.delta.tool_calls or []
    assert reasoning == "I should look it up." and [c.function.name for c in calls] == ["get_weather"]


def test_gemma4_channels_and_enable_thinking(served):
    engine, oai = served(GEMMA4_THINKING, "gemma4")
    engine.scripts = ["<|channel>thought\nAdd them.<channel|>It is 4."]
    out = oai.chat.completions.create(model="fake-model", messages=ASK,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert "<|think|>" in engine.prompts[0]
    assert engine.params[0].skip_special_tokens is False  # the channel markers are special tokens
    msg = out.choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == ("Add them.", "It is 4.")
    assert out.usage.completion_tokens_details.reasoning_tokens == len("<|channel>thought\nAdd them.<channel|>")


def test_responses_api_reasoning_item(served):
    engine, oai = served()
    engine.scripts = [QWEN_ANSWER, QWEN_ANSWER]
    resp = oai.responses.create(model="fake-model", input="What is 2 + 2?")
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == THOUGHT and resp.output_text == "It is 4."
    assert resp.usage.output_tokens_details.reasoning_tokens == len(THOUGHT + "\n</think>")
    events = list(oai.responses.create(model="fake-model", input="What is 2 + 2?", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[first_text - 4:first_text] == ["response.reasoning_text.done", "response.output_item.done",
                                                "response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It is 4."
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].type == "reasoning"

    # nothing is stored: a client replays the output items as input, and the reasoning reaches the template
    engine.scripts = ["Checked.\n</think>\n\nYes."]
    history = [{"role": "user", "content": "What is 2 + 2?"}, *[i.model_dump(exclude_none=True) for i in resp.output],
               {"role": "user", "content": "Sure?"}]
    again = oai.responses.create(model="fake-model", input=history)
    assert again.output_text == "Yes."
    assert f"<|im_start|>assistant\n<think>\n{THOUGHT}\n</think>\n\nIt is 4.<|im_end|>" in engine.prompts[-1]
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model="fake-model", input=[i.model_dump(exclude_none=True) for i in resp.output[:1]])


def test_bad_template_kwargs_and_structured_output_after_reasoning(served):
    engine, oai = served()
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="fake-model", messages=ASK, extra_body={"chat_template_kwargs": {"tools": []}})
    assert err.value.body["param"] == "chat_template_kwargs"
    # the fake vocabulary has no one-token </think>: a constraint cannot wait for it
    with pytest.raises(openai.BadRequestError, match="one token"):
        oai.chat.completions.create(model="fake-model", messages=ASK, response_format={"type": "json_object"})
    engine.scripts = ['{"a": 1}']  # thinking off: the grammar holds from the first token
    out = oai.chat.completions.create(model="fake-model", messages=ASK, response_format={"type": "json_object"},
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content == '{"a": 1}'
    assert engine.params[-1].structured_output == {"json_object": True}
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        create_app(FakeEngine(), reasoning_parser="nope")


def test_grammar_waits_for_the_end_of_the_reasoning():
    setup = ReasoningSetup(QWEN, in_reasoning=True, end_token_id=7, include=True)
    params = grammar_after_reasoning(setup, SamplingParams(structured_output={"json_object": True}), "response_format")
    assert params.structured_output == {"json_object": True, "after_token_id": 7}
    closed = ReasoningSetup(QWEN, in_reasoning=False, end_token_id=7, include=True)
    assert grammar_after_reasoning(closed, params, "x") is params
    with pytest.raises(APIError):
        grammar_after_reasoning(ReasoningSetup(QWEN, True, None, True), params, "response_format")


def test_serve_flag_reaches_the_app(monkeypatch):
    """`serve --reasoning-parser qwen3`: run_server hands the parser to the app (engine, uvicorn and the thread
    settings replaced; nothing listens)."""
    import argparse
    import signal

    import uvicorn

    import compiled_llm.runtime.engine as engine_module
    import compiled_llm.server.async_engine as async_engine
    from compiled_llm.server.cli import add_serve_args, run_server

    seen = {}

    class Server:
        started = True

        def __init__(self, config):
            seen["reasoning"] = config.app.state.server.reasoning_parser

        def run(self):
            pass

    monkeypatch.setattr(engine_module, "LLMEngine", lambda config: FakeEngine())
    monkeypatch.setattr(async_engine, "one_thread_elsewhere", lambda: None)
    monkeypatch.setattr(uvicorn, "Server", Server)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        args = add_serve_args(argparse.ArgumentParser()).parse_args(["--reasoning-parser", "qwen3"])
        assert run_server(args) == 0
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert seen["reasoning"] is QWEN
    with pytest.raises(SystemExit):
        add_serve_args(argparse.ArgumentParser()).parse_args(["--reasoning-parser", "deepseek"])
