"""Measuring a sparse-KV method against dense attention: greedy agreement and teacher-forced perplexity.

Both run the real engine (prefill, chunking, decode steps), so the sparse method acts exactly as it does
when serving: `teacher_forced_logprobs` swaps the engine's sampler for one that emits the given
continuation token by token and records each token's log-probability under the model's logits.
"""

from __future__ import annotations

import math

import torch

from compiled_llm.runtime.sampler import SampleResult
from compiled_llm.sampling_params import SamplingParams


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def agreement(ours: list[int], ref: list[int]) -> dict:
    """Share of positions where the tokens match, and the first position where they differ (len if none)."""
    n = min(len(ours), len(ref))
    same = sum(a == b for a, b in zip(ours, ref))
    first = next((i for i in range(n) if ours[i] != ref[i]), n)
    return {"match_rate": same / n if n else 1.0, "first_divergence": first}


class _ForcedSampler:
    def __init__(self, target: list[int]):
        self.target = target
        self.logprobs: list[float] = []

    def __call__(self, logits: torch.Tensor, rows) -> list[SampleResult]:
        assert len(rows) == 1, "one forced sequence at a time"
        step = len(rows[0].output_token_ids)
        token = self.target[step]
        lp = torch.log_softmax(logits[0].float(), dim=-1)[token].item()
        self.logprobs.append(lp)
        return [SampleResult(token_id=token, logprob=lp)]


def teacher_forced_logprobs(llm, prompt: list[int], target: list[int]) -> list[float]:
    """Log-probability of each target token given the prompt and the target tokens before it, computed
    through the engine's decode steps (so a sparse method applies to every token after the first)."""
    engine = llm.engine
    forced = _ForcedSampler(target)
    saved, engine.sampler = engine.sampler, forced
    try:
        rid = f"forced-{id(forced)}"
        engine.add_request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=len(target), ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.sampler = saved
    return forced.logprobs


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs)) if logprobs else float("nan")
