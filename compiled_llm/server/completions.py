"""POST /v1/completions."""

from __future__ import annotations

import time

from fastapi import Request

from compiled_llm.server.errors import APIError
from compiled_llm.server.generation import Generation
from compiled_llm.server.inputs import check_context, completion_prompts, sampling_params, tokenize_prompts
from compiled_llm.server.logprobs import completion_entries
from compiled_llm.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from compiled_llm.server.state import ServerState, new_id
from compiled_llm.server.streaming import ClientGone, client_gone_response, run_generation, sse, stream
from compiled_llm.server.structured_output import RESPONSE_FORMAT_PARAM, response_format_output


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    model = state.model_name(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported", param="echo")
    constraint = response_format_output(req.response_format)
    prompts = completion_prompts(req.prompt)
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, vocab_size=state.vocab_size,
                             structured_output=constraint)
    # Text prompts are tokenized here, not on the engine thread, and checked against the context.
    ids = await tokenize_prompts(state, prompts)
    for p in ids:
        if p:
            check_context(len(p), req.max_tokens, state.max_model_len, "max_tokens", "prompt")
    rid = new_id("cmpl-")
    gen = Generation(state.aengine, rid, ids, params, RESPONSE_FORMAT_PARAM)
    await gen.start()
    created = int(time.time())
    echoes = [_prompt_text(state, p) if req.echo else "" for p in prompts]

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return stream(gen, _chunks(state, gen, rid, created, model, params.logprobs, echoes, include_usage),
                      on_error=state.error_observer(request.url.path))

    try:
        await run_generation(request, gen)
    except ClientGone:
        return client_gone_response()
    choices = []
    for c in gen.choices:
        lps = None
        if params.logprobs is not None:
            lps = CompletionLogprobs(**completion_entries(c.token_ids, c.logprobs, params.logprobs,
                                                          state.token_text, 0))
        choices.append(CompletionChoice(index=c.index, text=echoes[c.index // params.n] + c.text, logprobs=lps,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=gen.usage())


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


async def _chunks(state, gen: Generation, rid, created, model, top_n, echoes, include_usage):
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    offsets = [0] * len(gen.choices)

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        return sse({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": stop_reason}]})

    for c in gen.choices:
        if echoes[c.index // gen.params.n]:
            yield chunk(c.index, echoes[c.index // gen.params.n])
    async for deltas in gen.deltas():
        for d in deltas:
            i = d.choice.index
            lps = None
            if top_n is not None:
                lps = completion_entries(d.token_ids, d.logprobs, top_n, state.token_text, offsets[i])
                offsets[i] += sum(len(t) for t in lps["tokens"])
            elif not d.text and not d.finished:
                continue
            yield chunk(i, d.text, lps, d.choice.finish_reason if d.finished else None,
                        d.choice.stop_reason if d.finished else None)
    if include_usage:
        yield sse({**base, "choices": [], "usage": gen.usage().model_dump()})
    yield sse("[DONE]")
