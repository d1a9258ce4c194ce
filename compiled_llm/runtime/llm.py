"""The offline Python API, shaped like vLLM's: LLM(model=...).generate(prompts, params)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import fields

from tqdm import tqdm

from compiled_llm.config import EngineConfig
from compiled_llm.outputs import RequestOutput
from compiled_llm.runtime.engine import LLMEngine
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | dict | list[int]


class LLM:
    """An engine and its generate loop. Not thread safe: one thread at a time. On the CPU, call it from the thread
    that built it: a second thread running torch's parallel ops makes OpenMP stop spinning between them, and a
    tiny model's steps ran 3-4x slower (the server builds and steps its engine on one thread for this reason)."""

    def __init__(self, model: str | None = None, **kwargs):
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        return cls(**{f.name: getattr(config, f.name) for f in fields(EngineConfig)})

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _prompt(self, p: Prompt) -> str | list[int]:
        if isinstance(p, str):
            return p
        if isinstance(p, dict):
            if p.get("multi_modal_data"):  # media: the engine runs the checkpoint's processor
                return p
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return p["prompt"]
        if isinstance(p, list) and all(isinstance(t, int) for t in p):
            return p
        raise ValueError("a prompt is a string, {'prompt': str} or {'prompt_token_ids': [int, ...]}")

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | list[SamplingParams] | None
                 = None, use_tqdm: bool = False, priority: list[int] | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. priority (scheduling_policy "priority"): one per prompt, lower first."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        return self._run([self._prompt(p) for p in prompts], params, use_tqdm, priority)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = False, chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Each conversation through the chat template (chat_template_kwargs: extra template variables, e.g.
        {"enable_thinking": False}; continue_final_message: the model goes on with the last message, an answer
        begun by the caller, with add_generation_prompt=False), then generated as token ids."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in convs:
            text = self.engine.apply_chat_template(conv, add_generation_prompt, chat_template, chat_template_kwargs,
                                                   continue_final_message)
            prompts.append(self.engine.tokenize(text, add_special_tokens=False))
        return self.generate([{"prompt_token_ids": p} for p in prompts], sampling_params, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
             priority: list[int] | None = None) -> list[RequestOutput]:
        ids = []
        # one output a request, when it ends (vLLM's LLM does the same): no per-step copy of a growing output
        final = {id(p): p if p.output_kind == RequestOutputKind.FINAL_ONLY else
                 dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params}
        params = [final[id(p)] for p in params]
        try:
            for k, (prompt, p) in enumerate(zip(prompts, params)):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, prompt, p, priority=priority[k] if priority else 0)
                ids.append(rid)
        except ValueError:
            for rid in ids:  # leave the engine as it was
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", disable=not use_tqdm)
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in ids:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]
