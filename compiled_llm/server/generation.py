"""One HTTP request's generation: its engine requests, per-choice state and streamed deltas."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from compiled_llm.outputs import Logprob
from compiled_llm.runtime.errors import EngineDeadError as RuntimeEngineDead
from compiled_llm.runtime.errors import StructuredOutputError
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.server.async_engine import AsyncEngine, EngineDeadError, Update
from compiled_llm.server.errors import APIError
from compiled_llm.server.protocol import PromptTokensDetails, Usage


@dataclass
class Choice:
    index: int
    text: str = ""  # latest full text from the engine
    sent: int = 0  # characters already streamed
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Delta:
    choice: Choice
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finished: bool  # the choice finished in this update


class Generation:
    """Runs one engine request per prompt (each with params.n samples); choice i*n+j is sample j of prompt i."""

    def __init__(self, aengine: AsyncEngine, request_id: str, prompts: list[str | list[int]],
                 params: SamplingParams, structured_param: tuple[str, str] | None = None, priority: int = 0):
        """structured_param: (request field, path of its schema) that params.structured_output came from, named
        when admission refuses the constraint (a schema that does not compile). priority: the engine's scheduling
        priority (lower first; the "priority" policy)."""
        self.aengine = aengine
        self.priority = priority
        self.structured_param = structured_param or ("response_format", "response_format")
        self.params = params
        self.prompts = prompts
        self.rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        self._prompt_index = {rid: i for i, rid in enumerate(self.rids)}
        self.choices = [Choice(i) for i in range(len(prompts) * params.n)]
        # known from the token ids given (a media prompt's after its processor), so a stream's usage counts them
        # from its first chunk; the engine's count replaces them with each update
        self.prompt_tokens = [len(p) if isinstance(p, list) else len(getattr(p, "token_ids", ())) for p in prompts]
        self.cached_tokens = [0] * len(prompts)
        # params.prompt_logprobs: each prompt's token ids and entries, once the engine has computed it
        self.prompt_logprobs: list[tuple[list[int], list] | None] = [None] * len(prompts)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished: set[str] = set()
        # A stop string can complete in a later step and cut text off; hold back enough to never
        # stream text that may be cut.
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    async def start(self) -> None:
        """Submit every prompt at once; if one is rejected abort the others and raise APIError. A constrained
        request's grammar is compiled first, in a worker thread, never on the engine thread."""
        if self.params.structured_output is not None:
            try:
                await self.aengine.prepare_structured_output(self.params.structured_output)
            except StructuredOutputError as e:
                raise self._refused_constraint(e) from e
        self._unfinished.update(self.rids)
        try:
            results = await asyncio.gather(
                *(self.aengine.add(rid, p, self.params, self._queue, self.priority)
                  for rid, p in zip(self.rids, self.prompts)),
                return_exceptions=True)
        except BaseException:
            self.close()
            raise
        for i, res in enumerate(results):
            if isinstance(res, BaseException):
                self.close()
                if isinstance(res, RuntimeEngineDead):  # the server's, or a worker that died at admission
                    raise APIError(503, str(res), code="engine_dead") from res
                if isinstance(res, StructuredOutputError):
                    raise self._refused_constraint(res) from res
                if isinstance(res, (ValueError, TypeError, OverflowError)):  # the request's own input
                    raise APIError(400, str(res), param="prompt" if len(self.rids) == 1 else f"prompt.{i}") from res
                raise res

    def _refused_constraint(self, e: StructuredOutputError) -> APIError:
        """The 400 for a constraint that does not compile, naming the request field it came from."""
        param, where = self.structured_param
        return APIError(400, f"{where}: {e}", param=param)

    def close(self) -> None:
        """Abort what has not finished (client gone, error, shutdown)."""
        for rid in self._unfinished:
            self.aengine.abort(rid)
        self._unfinished.clear()

    async def deltas(self):
        """Yields a list of Delta after each engine update until every choice finished."""
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            deltas = self._apply(item)
            if deltas:
                yield deltas

    async def run(self) -> None:
        async for _ in self.deltas():
            pass

    def _apply(self, upd: Update) -> list[Delta]:
        p = self._prompt_index[upd.request_id]
        self.prompt_tokens[p] = upd.num_prompt_tokens
        self.cached_tokens[p] = upd.num_cached_tokens
        if upd.prompt_logprobs is not None:
            self.prompt_logprobs[p] = upd.prompt_logprobs
        out = []
        for s in upd.seqs:
            c = self.choices[p * self.params.n + s.index]
            if c.finish_reason is not None:
                continue
            c.token_ids.extend(s.new_token_ids)
            if s.new_logprobs:
                c.logprobs.extend(s.new_logprobs)
            c.text = s.text
            done = s.finish_reason is not None
            end = len(c.text) if done else max(len(c.text) - self._holdback, c.sent)
            text = c.text[c.sent:end]
            c.sent = max(c.sent, end)
            if done:
                c.finish_reason, c.stop_reason = s.finish_reason, s.stop_reason
            if text or s.new_token_ids or done:
                out.append(Delta(c, text, s.new_token_ids, s.new_logprobs or [], done))
        if upd.finished:
            self._unfinished.discard(upd.request_id)
        return out

    # --- usage -------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens)

    def usage(self) -> Usage:
        p, c = self.num_prompt_tokens, self.num_generated_tokens
        return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens))
