"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from fastapi import Request

from compiled_llm.server.errors import APIError
from compiled_llm.server.generation import Generation
from compiled_llm.server.inputs import chat_engine_prompt, check_context, engine_prompt_ids, sampling_params
from compiled_llm.server.logprobs import chat_entries
from compiled_llm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    FunctionCall,
    ToolCall,
)
from compiled_llm.server.state import ServerState, new_id
from compiled_llm.server.streaming import ClientGone, client_gone_response, run_generation, sse, stream
from compiled_llm.server.structured_output import RESPONSE_FORMAT_PARAM, response_format_output
from compiled_llm.server.tool_parsers import CallEvent, ContentEvent
from compiled_llm.server.tools import ToolSetup, finish_reason, parse_output, tool_setup


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    model = state.model_name(req.model)
    constraint = response_format_output(req.response_format)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    tools = tool_setup(state, req)
    if tools is not None and constraint is not None:
        raise APIError(400, f"response_format type `{req.response_format.type}` together with tools is not "
                            "supported: the grammar would forbid the tool calls", param="response_format")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens=max_tokens, vocab_size=state.vocab_size,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             structured_output=constraint,
                             **(tools.sampling_overrides(req.stop) if tools else {}))
    prompt = await chat_engine_prompt(state, req.messages, req.add_generation_prompt,  # media: a ProcessedPrompt
                                      tools=tools.tools if tools else None, prefix=tools.prefix if tools else "")
    check_context(len(engine_prompt_ids(prompt)), max_tokens, state.max_model_len,
                  "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    rid = new_id("chatcmpl-")
    gen = Generation(state.aengine, rid, [prompt], params, RESPONSE_FORMAT_PARAM)
    await gen.start()
    created = int(time.time())
    top_n = params.logprobs

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream(gen, _chunks(state, gen, rid, created, model, top_n, include_usage, tools),
                      on_error=state.error_observer(request.url.path))

    try:
        await run_generation(request, gen)
    except ClientGone:
        return client_gone_response()
    choices = []
    for c in gen.choices:
        lps = None
        if top_n is not None:
            lps = ChoiceLogprobs(content=chat_entries(c.token_ids, c.logprobs, top_n, state.token_text))
        message, reason = AssistantMessage(content=c.text), c.finish_reason
        if tools is not None:
            out = parse_output(tools, c.text)
            calls = [ToolCall(id=e.id, function=FunctionCall(name=e.name, arguments=e.arguments)) for e in out.calls]
            message = AssistantMessage(content=out.content, tool_calls=calls or None)
            reason = finish_reason(c.finish_reason, len(calls))
        choices.append(ChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=reason,
                                  stop_reason=c.stop_reason))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices, usage=gen.usage())


def _tool_deltas(events: list, parallel: bool) -> list[dict]:
    out = []
    for e in events:
        if isinstance(e, ContentEvent):
            out.append({"content": e.text})
        elif isinstance(e, CallEvent) and (parallel or e.index == 0):
            out.append({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                        "function": {"name": e.name, "arguments": e.arguments}}]})
    return out


async def _chunks(state: ServerState, gen: Generation, rid: str, created: int, model: str, top_n: int | None,
                  include_usage: bool, tools: ToolSetup | None):
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    streams = {c.index: tools.stream() for c in gen.choices} if tools is not None else {}

    def chunk(choice: dict) -> str:
        return sse({**base, "choices": [choice]})

    for c in gen.choices:
        yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    async for deltas in gen.deltas():
        for d in deltas:
            i = d.choice.index
            if tools is None:
                pieces = [{"content": d.text}] if d.text else []
            else:  # content and whole tool calls, as the extractor finds them
                events = streams[i].feed(d.text) if d.text else []
                if d.finished:
                    events += streams[i].finish()
                pieces = _tool_deltas(events, tools.parallel)
            if not pieces and not d.finished and top_n is None:
                continue
            pieces = pieces or [{}]
            for k, delta in enumerate(pieces):
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                if k == 0 and top_n is not None:
                    choice["logprobs"] = {"content": chat_entries(d.token_ids, d.logprobs, top_n, state.token_text)}
                if d.finished and k == len(pieces) - 1:
                    calls = len(streams[i].calls) if tools is not None else 0
                    choice["finish_reason"] = finish_reason(d.choice.finish_reason, calls)
                    choice["stop_reason"] = d.choice.stop_reason
                yield chunk(choice)
    if include_usage:
        yield sse({**base, "choices": [], "usage": gen.usage().model_dump()})
    yield sse("[DONE]")
