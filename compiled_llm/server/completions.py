"""POST /v1/completions."""

from __future__ import annotations

import time

from fastapi import Request

from compiled_llm.server.errors import APIError
from compiled_llm.server.generation import Generation
from compiled_llm.server.inputs import (
    check_context,
    completion_prompts,
    request_priority,
    sampling_params,
    tokenize_prompts,
    truncate_prompt,
)
from compiled_llm.server.logprobs import completion_entries, token_id_text, top_n_entries, vllm_prompt_logprobs
from compiled_llm.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from compiled_llm.server.state import ServerState, new_id
from compiled_llm.server.streaming import ClientGone, client_gone_response, run_generation, sse, stream, usage_modes
from compiled_llm.server.structured_output import request_constraint


async def create_completion(state: ServerState, req: CompletionRequest, request: Request):
    model = state.model_name(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not supported with stream (echo with logprobs is)",
                       param="prompt_logprobs")
    constraint, constraint_param = request_constraint(req)
    prompts = completion_prompts(req.prompt)
    echo_lps = req.logprobs if req.echo else None  # echo + logprobs: the prompt's tokens are scored too
    wanted = [n for n in (echo_lps, req.prompt_logprobs) if n is not None]
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, vocab_size=state.vocab_size,
                             structured_output=constraint, prompt_logprobs=max(wanted) if wanted else None)
    # Text prompts are tokenized here, not on the engine thread, and checked against the context.
    tokenized = await tokenize_prompts(state, prompts)
    ids = [truncate_prompt(params, p, state.max_model_len) for p in tokenized]
    for p in ids:
        if p:
            check_context(len(p), req.max_tokens, state.max_model_len, "max_tokens", "prompt")
    rid = new_id("cmpl-")
    gen = Generation(state.aengine, rid, ids, params, constraint_param, request_priority(state, req))
    await gen.start()
    created = int(time.time())
    # echo: the prompt as given, or as cut by truncate_prompt_tokens (what the model saw)
    echoes = [_prompt_text(state, q if len(q) < len(t) else p) if req.echo else ""
              for p, t, q in zip(prompts, tokenized, ids)]

    token_text = token_id_text if req.return_tokens_as_token_ids else state.token_text
    if req.stream:
        include_usage, continuous = usage_modes(req.stream_options)
        return stream(gen, _chunks(state, gen, rid, created, model, params.logprobs, echoes, include_usage,
                                   echo_lps is not None, token_text, continuous),
                      on_error=state.error_observer(request.url.path))

    try:
        await run_generation(request, gen)
    except ClientGone:
        return client_gone_response()
    choices = []
    for c in gen.choices:
        p = c.index // params.n
        lps = prompt_lps = None
        if params.logprobs is not None:
            entries = _echo_entries(gen, p, params.logprobs, token_text) if echo_lps is not None else None
            offset = len(echoes[p]) if entries is None else sum(len(t) for t in entries["tokens"])
            gen_entries = completion_entries(c.token_ids, c.logprobs, params.logprobs, token_text, offset)
            lps = CompletionLogprobs(**_joined(entries, gen_entries))
        if req.prompt_logprobs is not None and gen.prompt_logprobs[p] is not None:
            prompt_lps = vllm_prompt_logprobs(top_n_entries(gen.prompt_logprobs[p], req.prompt_logprobs))
        choices.append(CompletionChoice(index=c.index, text=echoes[p] + c.text, logprobs=lps,
                                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                        prompt_logprobs=prompt_lps))
    return CompletionResponse(id=rid, created=created, model=model, choices=choices, usage=gen.usage())


def _echo_entries(gen: Generation, p: int, top_n: int, token_text) -> dict | None:
    """The completions logprobs of prompt p's own tokens (echo with logprobs); None before they are known."""
    entries = gen.prompt_logprobs[p]
    if entries is None:
        return None
    return completion_entries(gen.prompts[p], entries, top_n, token_text, 0)


def _joined(first: dict | None, second: dict) -> dict:
    return second if first is None else {k: first[k] + second[k] for k in second}


def _prompt_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt)


async def _chunks(state, gen: Generation, rid, created, model, top_n, echoes, include_usage, echo_scored: bool,
                  token_text, continuous: bool = False):
    """echo_scored (echo with logprobs): each choice's echo waits for its prompt's logprobs, which come with the
    first generated token. continuous (stream_options.continuous_usage_stats): each chunk carries the usage so
    far."""
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    offsets = [0] * len(gen.choices)
    n = gen.params.n

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        return sse({**base, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                         "finish_reason": finish_reason, "stop_reason": stop_reason}],
                    **({"usage": gen.usage().model_dump()} if continuous else {})})

    waiting = {c.index for c in gen.choices if echoes[c.index // n]} if echo_scored else set()
    for c in gen.choices:
        if echoes[c.index // n] and not echo_scored:
            yield chunk(c.index, echoes[c.index // n])
    async for deltas in gen.deltas():
        for d in deltas:
            i = d.choice.index
            if i in waiting:
                waiting.discard(i)
                entries = _echo_entries(gen, i // n, top_n, token_text)
                if entries is not None:
                    offsets[i] = sum(len(t) for t in entries["tokens"])
                yield chunk(i, echoes[i // n], entries)
            lps = None
            if top_n is not None:
                lps = completion_entries(d.token_ids, d.logprobs, top_n, token_text, offsets[i])
                offsets[i] += sum(len(t) for t in lps["tokens"])
            elif not d.text and not d.finished:
                continue
            yield chunk(i, d.text, lps, d.choice.finish_reason if d.finished else None,
                        d.choice.stop_reason if d.finished else None)
    if include_usage:
        yield sse({**base, "choices": [], "usage": gen.usage().model_dump()})
    yield sse("[DONE]")
