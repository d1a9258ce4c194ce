"""POST /v1/responses (text in, one text message out; no tools, no stored conversations)."""

from __future__ import annotations

import time

from fastapi import Request

from compiled_llm.server.errors import APIError
from compiled_llm.server.generation import Generation
from compiled_llm.server.inputs import chat_engine_prompt, check_context, engine_prompt_ids, sampling_params
from compiled_llm.server.logprobs import responses_entries
from compiled_llm.server.protocol import (
    IncompleteDetails,
    InputMessage,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningInput,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from compiled_llm.server.reasoning import (
    ReasoningSetup,
    grammar_after_reasoning,
    reasoning_overrides,
    reasoning_setup,
)
from compiled_llm.server.state import ServerState, new_id
from compiled_llm.server.structured_output import structured_output
from compiled_llm.server.streaming import ClientGone, client_gone_response, run_generation, sse, stream

LOGPROBS_INCLUDE = "message.output_text.logprobs"


async def create_response(state: ServerState, req: ResponsesRequest, request: Request):
    model = state.model_name(req.model)
    fmt = req.text.format if req.text else None
    constraint = structured_output(fmt and fmt.type, fmt and fmt.schema_, "text", "text.format.schema")
    if req.previous_response_id is not None:
        raise APIError(400, "previous_response_id is not supported: responses are not stored",
                       param="previous_response_id")
    items = [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else _messages(req.input)
    want_lps = req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or [])
    params = sampling_params(req, max_tokens=req.max_output_tokens, vocab_size=state.vocab_size,
                             logprobs=(req.top_logprobs or 0) if want_lps else None, structured_output=constraint,
                             **reasoning_overrides(state))
    prompt = await chat_engine_prompt(state, items, True, req.instructions)  # media: a ProcessedPrompt
    prompt_ids = engine_prompt_ids(prompt)
    check_context(len(prompt_ids), req.max_output_tokens, state.max_model_len, "max_output_tokens", "input")
    reasoning = reasoning_setup(state, prompt_ids, True)
    params = grammar_after_reasoning(reasoning, params, "text")
    builder = _Builder(state, req, model, want_lps, reasoning)
    gen = Generation(state.aengine, builder.id, [prompt], params, ("text", "text.format.schema"))
    await gen.start()

    if req.stream:
        return stream(gen, builder.events(gen), error_event=builder.error_event,
                      on_error=state.error_observer(request.url.path))
    try:
        await run_generation(request, gen)
    except ClientGone:
        return client_gone_response()
    return builder.response(gen, done=True)


def _messages(items: list) -> list[InputMessage]:
    """Input items -> messages: a reasoning item (an earlier response's, fed back) becomes the reasoning of the
    assistant message after it, which the chat template may render (Qwen's reads reasoning_content)."""
    out, thought = [], None
    for item in items:
        if isinstance(item, ReasoningInput):
            thought = "".join(p.text for p in item.content or [])
            continue
        if item.role == "assistant" and thought:
            item._reasoning = thought
        thought = None
        out.append(item)
    if not out:
        raise APIError(400, "input has no message", param="input")
    return out


class _Builder:
    """Builds the response object and the stream events of one response."""

    def __init__(self, state: ServerState, req: ResponsesRequest, model: str, want_lps: bool,
                 reasoning: ReasoningSetup | None):
        self.state, self.req, self.model, self.reasoning = state, req, model, reasoning
        self.id, self.msg_id, self.rs_id = new_id("resp_"), new_id("msg_"), new_id("rs_")
        self.created = int(time.time())
        self.top_n = (req.top_logprobs or 0) if want_lps else None
        self.seq = 0

    def _lps(self, token_ids, lps):
        if self.top_n is None:
            return []
        return responses_entries(token_ids, lps, self.top_n, self.state.token_text)

    def _part(self, text: str, token_ids=(), lps=()) -> OutputText:
        return OutputText(text=text, logprobs=self._lps(list(token_ids), list(lps)) if self.top_n is not None else None)

    def _message(self, status: str, parts: list[OutputText]) -> OutputMessage:
        return OutputMessage(id=self.msg_id, status=status, content=parts)

    def _reasoning_item(self, status: str, text: str | None) -> ReasoningItem:
        content = [ReasoningText(text=text)] if text is not None else []
        return ReasoningItem(id=self.rs_id, status=status, content=content)

    def _encode(self, text: str) -> list[int]:
        return self.state.tokenizer.encode(text, add_special_tokens=False)

    def response(self, gen: Generation | None, done: bool) -> ResponseObject:
        status, incomplete, output, usage = "in_progress", None, [], None
        if done:
            c = gen.choices[0]
            status = "incomplete" if c.finish_reason == "length" else "completed"
            if status == "incomplete":
                incomplete = IncompleteDetails(reason="max_output_tokens")
            text, thought, n_thought = c.text, None, 0
            if self.reasoning is not None:
                split = self.reasoning.split(c.text)
                text, thought = split.content or "", split.reasoning
                n_thought = self.reasoning.count_tokens(c.token_ids, c.text, split, self._encode)
            output = [self._reasoning_item(status, thought)] if thought is not None else []
            output.append(self._message(status, [self._part(text, c.token_ids, c.logprobs)]))
            i, o = gen.num_prompt_tokens, gen.num_generated_tokens
            usage = ResponseUsage(input_tokens=i,
                                  input_tokens_details=InputTokensDetails(cached_tokens=gen.num_cached_tokens),
                                  output_tokens=o, total_tokens=i + o,
                                  output_tokens_details=OutputTokensDetails(reasoning_tokens=n_thought))
        return ResponseObject(id=self.id, created_at=self.created, status=status, incomplete_details=incomplete,
                              model=self.model, instructions=self.req.instructions, output=output,
                              temperature=self.req.temperature, top_p=self.req.top_p,
                              max_output_tokens=self.req.max_output_tokens, metadata=self.req.metadata,
                              text=self._text_config(), usage=usage)

    def _text_config(self) -> dict:
        """The request's text config echoed (its format: text, json_object or json_schema)."""
        fmt = self.req.text.format if self.req.text else None
        if fmt is None:
            return {"format": {"type": "text"}}
        return {"format": fmt.model_dump(mode="json", by_alias=True, exclude_none=True)}

    def _event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, event=kind)

    def error_event(self, status: int, message: str, code: str | None) -> str:
        return self._event("error", code=code or str(status), message=message, param=None)

    def _open_message(self, where: dict) -> list[str]:
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item=self._message("in_progress", []).model_dump(mode="json")),
                self._event("response.content_part.added", **where,
                            part=OutputText(text="").model_dump(mode="json", exclude_none=True))]

    def _close_reasoning(self, text: str, status: str) -> list[str]:
        item = self._reasoning_item(status, text)
        return [self._event("response.reasoning_text.done", item_id=self.rs_id, output_index=0, content_index=0,
                            text=text),
                self._event("response.output_item.done", output_index=0, item=item.model_dump(mode="json"))]

    async def events(self, gen: Generation):
        """The stream. With a reasoning parser, a reasoning item comes first when the model thinks (its text as
        reasoning_text deltas) and the message item opens with the first answer text; without, the message item
        opens at once."""
        start = self.response(None, done=False).model_dump(mode="json")
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        split = self.reasoning.stream() if self.reasoning is not None else None
        items: list[str] = []  # output items opened so far: "reasoning", "message"
        thought = ""
        where: dict = {}
        token_ids, lps = [], []  # tokens whose logprobs no text delta has carried yet

        def open_message(status: str = "completed") -> list[str]:
            out = self._close_reasoning(thought, status) if items == ["reasoning"] else []
            items.append("message")
            where.update(item_id=self.msg_id, output_index=len(items) - 1, content_index=0)
            return out + self._open_message(where)

        if split is None:
            for e in open_message():
                yield e
        async for deltas in gen.deltas():
            for d in deltas:
                token_ids, lps = token_ids + d.token_ids, lps + d.logprobs
                if split is None:
                    pieces = [("content", d.text)]
                else:
                    pieces = (split.feed(d.text) if d.text else []) + (split.finish() if d.finished else [])
                for kind, text in pieces:
                    if kind == "reasoning":
                        if not items:
                            items.append("reasoning")
                            yield self._event("response.output_item.added", output_index=0,
                                              item=self._reasoning_item("in_progress", None).model_dump(mode="json"))
                        thought += text
                        yield self._event("response.reasoning_text.delta", item_id=self.rs_id, output_index=0,
                                          content_index=0, delta=text)
                        continue
                    if "message" not in items:
                        for e in open_message():
                            yield e
                    if text or (self.top_n is not None and token_ids):
                        yield self._event("response.output_text.delta", **where, delta=text,
                                          logprobs=self._lps(token_ids, lps))
                        token_ids, lps = [], []
        final = self.response(gen, done=True)
        if "message" not in items:
            for e in open_message(final.status):
                yield e
        message = final.output[-1]
        part = message.content[0]
        yield self._event("response.output_text.done", **where, text=part.text, logprobs=part.logprobs or [])
        yield self._event("response.content_part.done", **where, part=part.model_dump(mode="json", exclude_none=True))
        yield self._event("response.output_item.done", output_index=where["output_index"],
                          item=message.model_dump(mode="json", exclude_none=True))
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self._event(kind, response=final.model_dump(mode="json"))
