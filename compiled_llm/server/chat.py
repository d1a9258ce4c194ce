"""POST /v1/chat/completions."""

from __future__ import annotations

import time

from fastapi import Request

from compiled_llm.server.errors import APIError
from compiled_llm.server.generation import Generation
from compiled_llm.server.inputs import (
    chat_engine_prompt,
    check_context,
    engine_prompt_ids,
    request_priority,
    sampling_params,
    truncate_prompt,
)
from compiled_llm.server.logprobs import chat_entries, token_id_text, top_n_entries, vllm_prompt_logprobs
from compiled_llm.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionTokensDetails,
    FunctionCall,
    ToolCall,
    Usage,
)
from compiled_llm.server.reasoning import (
    ReasoningSetup,
    grammar_after_reasoning,
    reasoning_overrides,
    reasoning_setup,
)
from compiled_llm.server.state import ServerState, new_id
from compiled_llm.server.streaming import ClientGone, client_gone_response, run_generation, sse, stream, usage_modes
from compiled_llm.server.structured_output import request_constraint
from compiled_llm.server.tool_parsers import CallEvent, ContentEvent
from compiled_llm.server.tools import ToolSetup, finish_reason, parse_output, tool_setup


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request):
    model = state.model_name(req.model)
    constraint, constraint_param = request_constraint(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not supported with stream", param="prompt_logprobs")
    tools = tool_setup(state, req)
    if tools is not None and constraint is not None:
        raise APIError(400, f"{constraint_param[0]} together with tools is not supported: the grammar would forbid "
                            "the tool calls", param=constraint_param[0])
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    overrides = {**(tools.sampling_overrides(req.stop) if tools else {}), **reasoning_overrides(state)}
    forced = tools.constraint() if tools else None  # a forced call's grammar (server/tools.py)
    params = sampling_params(req, max_tokens=max_tokens, vocab_size=state.vocab_size,
                             logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             structured_output=constraint or forced, prompt_logprobs=req.prompt_logprobs,
                             **overrides)
    prompt = await chat_engine_prompt(state, req.messages, req.add_generation_prompt,  # media: a ProcessedPrompt
                                      tools=tools.tools if tools else None, prefix=tools.prefix if tools else "",
                                      template_kwargs=req.chat_template_kwargs,
                                      continue_final_message=req.continue_final_message)
    prompt = truncate_prompt(params, prompt, state.max_model_len)
    prompt_ids = engine_prompt_ids(prompt)
    check_context(len(prompt_ids), max_tokens, state.max_model_len,
                  "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    reasoning = reasoning_setup(state, prompt_ids, req.include_reasoning)
    params = grammar_after_reasoning(reasoning, params, "tools" if forced and not constraint else constraint_param[0])
    rid = new_id("chatcmpl-")
    gen = Generation(state.aengine, rid, [prompt], params,
                     ("tools", "tools.function.parameters") if forced else constraint_param,
                     request_priority(state, req))
    await gen.start()
    created = int(time.time())
    top_n = params.logprobs
    echo = _echo(req)

    token_text = token_id_text if req.return_tokens_as_token_ids else state.token_text
    if req.stream:
        include_usage, continuous = usage_modes(req.stream_options)
        return stream(gen, _chunks(state, gen, rid, created, model, top_n, include_usage, tools, reasoning,
                                   token_text, continuous, echo),
                      on_error=state.error_observer(request.url.path))

    try:
        await run_generation(request, gen)
    except ClientGone:
        return client_gone_response()
    choices = []
    for c in gen.choices:
        lps = None
        if top_n is not None:
            lps = ChoiceLogprobs(content=chat_entries(c.token_ids, c.logprobs, top_n, token_text))
        content, thought = c.text, None
        if reasoning is not None:
            split = reasoning.split(c.text)
            content, thought = split.content, split.reasoning if reasoning.include else None
        message = AssistantMessage(content=content, reasoning=thought, reasoning_content=thought)
        reason = c.finish_reason
        if tools is not None:
            out = parse_output(tools, content or "")
            calls = [ToolCall(id=e.id, function=FunctionCall(name=e.name, arguments=e.arguments)) for e in out.calls]
            message.content, message.tool_calls = out.content, calls or None
            reason = finish_reason(c.finish_reason, len(calls))
        if echo:
            message.content = echo + (message.content or "")
        choices.append(ChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=reason,
                                  stop_reason=c.stop_reason))
    prompt_lps = None
    if req.prompt_logprobs is not None and gen.prompt_logprobs[0] is not None:
        prompt_lps = vllm_prompt_logprobs(top_n_entries(gen.prompt_logprobs[0], req.prompt_logprobs))
    return ChatCompletionResponse(id=rid, created=created, model=model, choices=choices,
                                  usage=_usage(state, gen, reasoning), prompt_logprobs=prompt_lps)


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text, where it has the answer's role (the assistant's, or with
    add_generation_prompt false the last message's own), to go before the answer."""
    last = req.messages[-1]
    if not req.echo or (req.add_generation_prompt and last.role != "assistant"):
        return ""
    if isinstance(last.content, str):
        return last.content
    # its text parts as the template got them (server/inputs.py _content joins them with newlines)
    return "\n".join(part.text for part in last.content or [] if part.type == "text")


def _usage(state: ServerState, gen: Generation, reasoning: ReasoningSetup | None) -> Usage:
    """The request's usage; with a reasoning parser, completion_tokens_details.reasoning_tokens too."""
    usage = gen.usage()
    if reasoning is not None:
        def encode(text):
            return state.tokenizer.encode(text, add_special_tokens=False)

        n = sum(reasoning.count_tokens(c.token_ids, c.text, reasoning.split(c.text), encode) for c in gen.choices)
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=n)
    return usage


class _ChoiceStream:
    """One streamed choice's text -> delta dicts: reasoning (with a reasoning parser), then content and whole tool
    calls (with tools), as each becomes known."""

    def __init__(self, tools: ToolSetup | None, reasoning: ReasoningSetup | None):
        self.tools = tools.stream() if tools is not None else None
        self.parallel = tools.parallel if tools is not None else True
        self.reasoning = reasoning.stream() if reasoning is not None else None
        self.include_reasoning = reasoning is None or reasoning.include

    @property
    def num_calls(self) -> int:
        return len(self.tools.calls) if self.tools is not None else 0

    def feed(self, text: str, finished: bool) -> list[dict]:
        out, content = [], text
        if self.reasoning is not None:
            pieces = self.reasoning.feed(text) if text else []
            if finished:
                pieces += self.reasoning.finish()
            content = "".join(t for kind, t in pieces if kind == "content")
            if self.include_reasoning:
                out += [{"reasoning": t, "reasoning_content": t} for kind, t in pieces if kind == "reasoning"]
        if self.tools is None:
            return out + ([{"content": content}] if content else [])
        events = self.tools.feed(content) if content else []
        if finished:
            events += self.tools.finish()
        return out + _tool_deltas(events, self.parallel)


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
                  include_usage: bool, tools: ToolSetup | None, reasoning: ReasoningSetup | None, token_text,
                  continuous: bool = False, echo: str = ""):
    """continuous (stream_options.continuous_usage_stats): each chunk carries the usage so far; echo: a chunk
    of it for each choice after the role."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    streams = {c.index: _ChoiceStream(tools, reasoning) for c in gen.choices}

    def chunk(choice: dict) -> str:
        return sse({**base, "choices": [choice], **({"usage": gen.usage().model_dump()} if continuous else {})})

    for c in gen.choices:
        yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None})
    for c in gen.choices if echo else ():
        yield chunk({"index": c.index, "delta": {"content": echo}, "logprobs": None, "finish_reason": None})
    async for deltas in gen.deltas():
        for d in deltas:
            i = d.choice.index
            pieces = streams[i].feed(d.text, d.finished)
            if not pieces and not d.finished and top_n is None:
                continue
            pieces = pieces or [{}]
            for k, delta in enumerate(pieces):
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                if k == 0 and top_n is not None:
                    choice["logprobs"] = {"content": chat_entries(d.token_ids, d.logprobs, top_n, token_text)}
                if d.finished and k == len(pieces) - 1:
                    choice["finish_reason"] = finish_reason(d.choice.finish_reason, streams[i].num_calls)
                    choice["stop_reason"] = d.choice.stop_reason
                yield chunk(choice)
    if include_usage:
        yield sse({**base, "choices": [], "usage": _usage(state, gen, reasoning).model_dump()})
    yield sse("[DONE]")
