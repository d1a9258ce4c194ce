"""Batched token sampler.

Order of operations for each step (all rows processed together with tensor ops):

1. raw logits -> log_softmax (only when some row asked for logprobs; these are the returned logprobs)
2. repetition penalty (HF/vLLM: tokens in prompt + output; positive logits divided, negative multiplied)
3. frequency / presence penalties (OpenAI: output tokens only; logit -= f * count + p * (count > 0))
4. logit_bias added; outside allowed_token_ids -inf; bad_words: a word's last token -inf where the output ends
   with the rest of it
   min_tokens: the row's stop_token_ids are set to -inf while len(output) < min_tokens
   structured output: the tokens a row's grammar does not allow now are set to -inf (one packed bitmask for the
   batch, applied on the logits' device: runtime/structured_output.py)
5. greedy rows: argmax of the penalised logits
6. other rows: temperature, top-k, top-p, min-p, softmax, then an exponential-race draw
   (argmax(probs / Exp(1))), with the row's own generator when it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from compiled_llm.ops.logits import argmax_rows
from compiled_llm.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence being sampled this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far (penalties, min_tokens)
    generator: torch.Generator | None = None  # per-sequence when params.seed is set, else None (global RNG)
    # eos ids (unless ignore_eos) + params.stop_token_ids; masked while len(output) < min_tokens
    stop_token_ids: set[int] = field(default_factory=set)
    grammar: object | None = None  # structured_output.GrammarState of a constrained sequence
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences the output may not contain


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None  # log-softmax of the raw logits at the sampled token
    rank: int | None = None  # 1-based rank of the sampled token under the raw logits
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # top-N (id, logprob), best first


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    data = [x + [pad] * (width - len(x)) for x in lists]
    return torch.tensor(data, dtype=torch.long, device=device).view(len(lists), width)


def _edits_logits(r: SamplingRow) -> bool:
    """Whether steps 2-4 may change this row's logits (penalties, bias, allowed ids, min_tokens, a grammar)."""
    p = r.params
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
            or p.logit_bias or p.allowed_token_ids or len(r.output_token_ids) < p.min_tokens
            or r.grammar is not None or bool(r.bad_words))


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, in place on ``logits`` [B, V]; returns it."""
    B, V = logits.shape
    dev = logits.device
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    use_rep = any(x != 1.0 for x in rep)
    use_fp = any(x != 0.0 for x in freq) or any(x != 0.0 for x in pres)
    if not (use_rep or use_fp):
        return logits

    # Output token counts [B, V]; ids outside [0, V) go to a dummy column V that is dropped.
    out_ids = _padded([[t if 0 <= t < V else V for t in r.output_token_ids] for r in rows], V, dev)
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=dev)
    if out_ids.numel():
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :V]
    out_mask = counts > 0

    if use_rep:
        prompt_ids = _padded([[t if 0 <= t < V else V for t in r.prompt_token_ids] for r in rows], V, dev)
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=dev)
        if prompt_ids.numel():
            seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :V] | out_mask
        rep_t = torch.tensor(rep, dtype=logits.dtype, device=dev).unsqueeze(1)
        penalty = torch.where(seen, rep_t, torch.ones_like(rep_t))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)

    if use_fp:
        freq_t = torch.tensor(freq, dtype=logits.dtype, device=dev).unsqueeze(1)
        pres_t = torch.tensor(pres, dtype=logits.dtype, device=dev).unsqueeze(1)
        logits = logits - freq_t * counts - pres_t * out_mask.to(logits.dtype)
    return logits


def apply_bias_and_allowed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logit_bias added and every token outside allowed_token_ids set to -inf, in place, for the rows that have
    them (one indexed update each for the whole batch)."""
    bias_rows, bias_ids, bias_vals, allow_rows, allow_ids = [], [], [], [], []
    for i, r in enumerate(rows):
        for t, b in (r.params.logit_bias or {}).items():
            bias_rows.append(i)
            bias_ids.append(t)
            bias_vals.append(float(b))
        if r.params.allowed_token_ids:
            allow_rows += [i] * len(r.params.allowed_token_ids)
            allow_ids += r.params.allowed_token_ids
    dev = logits.device
    if bias_rows:
        logits.index_put_((to_device(bias_rows, torch.long, dev), to_device(bias_ids, torch.long, dev)),
                          to_device(bias_vals, torch.float32, dev).to(logits.dtype), accumulate=True)
    if allow_rows:
        rows_t = sorted(set(allow_rows))
        blocked = torch.ones(len(rows_t), logits.shape[1], dtype=torch.bool, device=dev)
        where = {row: k for k, row in enumerate(rows_t)}
        at = to_device([where[i] for i in allow_rows], torch.long, dev)
        blocked[at, to_device(allow_ids, torch.long, dev)] = False
        idx = to_device(rows_t, torch.long, dev)
        logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's bad words: the last token of a word is -inf where the output ends with the word's other tokens
    (a one-token word: always), so no word is ever completed; one indexed update for the batch."""
    banned_rows, banned_ids = [], []
    for i, r in enumerate(rows):
        out = r.output_token_ids
        for word in r.bad_words:
            head = word[:-1]
            if len(out) >= len(head) and (not head or out[len(out) - len(head):] == head):
                banned_rows.append(i)
                banned_ids.append(word[-1])
    if banned_rows:
        dev = logits.device
        logits[to_device(banned_rows, torch.long, dev), to_device(banned_ids, torch.long, dev)] = float("-inf")
    return logits


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask each row's stop_token_ids to -inf while it has fewer than min_tokens outputs (in place)."""
    V = logits.shape[1]
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for i, r in enumerate(rows):
        if len(r.output_token_ids) < r.params.min_tokens:
            ids = set(r.stop_token_ids) | set(r.params.stop_token_ids or ())
            for t in ids:
                if 0 <= t < V:
                    row_idx.append(i)
                    tok_idx.append(t)
    if row_idx:
        dev = logits.device
        logits[to_device(row_idx, torch.long, dev), to_device(tok_idx, torch.long, dev)] = float("-inf")
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Mask logits [B, V] (already temperature-scaled) to -inf outside each row's allowed set.

    top-k keeps the k largest (0 = off); top-p keeps the smallest set of best tokens whose
    probability (after top-k) reaches p; min-p keeps tokens with prob >= min_p * max prob.
    """
    B, V = logits.shape
    dev = logits.device
    use_k = any(0 < k < V for k in top_k)
    use_p = any(p < 1.0 for p in top_p)
    if use_k or use_p:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        positions = torch.arange(V, device=dev).unsqueeze(0)
        if use_k:
            k_t = to_device([k if 0 < k < V else V for k in top_k], torch.long, dev).unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(positions >= k_t, float("-inf"))
        if use_p:
            p_t = to_device(top_p, torch.float32, dev).unsqueeze(1)
            probs = sorted_logits.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # probability mass strictly before each position
            drop = (before >= p_t) & (p_t < 1.0)
            drop[:, 0] = False  # always keep the best token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    if any(m > 0.0 for m in min_p):
        m_t = to_device(min_p, logits.dtype, dev).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * m_t
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list (or numpy array) as a tensor on `device`. On CUDA through pinned memory and a non-blocking
    copy: a plain `torch.tensor(..., device=cuda)` waits for the stream to drain, which would stall the next
    step's preparation behind the step still running (async scheduling)."""
    t = torch.from_numpy(data).to(dtype) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class PendingTokens:
    """Async scheduling: a launched step's sampled tokens, still on the device, for the next step's inputs.
    rows: seq_id -> its row in `tokens`."""

    tokens: torch.Tensor
    rows: dict[int, int]


def fill_pending(input_ids: torch.Tensor, fill: tuple[torch.Tensor, torch.Tensor], tokens: torch.Tensor) -> None:
    """Async scheduling: the placeholders in input_ids (rows fill[0]) get the previous step's sampled tokens
    (rows fill[1] of tokens), on the device, without waiting for them to reach the host."""
    input_ids[fill[0]] = tokens[fill[1]].to(input_ids.dtype)


@dataclass
class SampledBatch:
    """One step's draws, still on the device (`token_ids` feeds the next step's inputs under async
    scheduling); `results()` waits for the copies to the host and builds the SampleResults."""

    rows: list[SamplingRow]
    token_ids: torch.Tensor  # [B] on the device
    device_out: dict  # name -> device tensor (token ids, logprob bookkeeping)
    host_out: dict | None = None  # name -> pinned host copy (non-blocking), None: read with .tolist()
    event: object = None  # CUDA event after the host copies
    lp_rows: list[int] = field(default_factory=list)

    def results(self) -> list[SampleResult]:
        if self.event is not None:
            self.event.synchronize()
        out = {k: v.tolist() for k, v in (self.host_out if self.host_out is not None else self.device_out).items()}
        results = [SampleResult(token_id=t) for t in out["token_ids"]]
        rows = self.rows
        for j, i in enumerate(self.lp_rows):
            res = results[i]
            res.logprob = out["chosen_lp"][j]
            res.rank = out["ranks"][j]
            n = rows[i].params.logprobs
            if n > 0:
                res.top_logprobs = list(zip(out["top_ids"][j][:n], out["top_vals"][j][:n]))
        return results


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampleResult]:
        if logits.shape[0] == 0 and not rows:
            return []
        return self.launch(logits, rows).results()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow], defer: bool = False) -> SampledBatch:
        """Queues the sampling of every row on the logits' device. defer: also queue non-blocking copies of
        the results to pinned host memory and an event after them, so nothing here waits for the device."""
        B, V = logits.shape
        if B != len(rows):
            raise ValueError(f"logits has {B} rows but {len(rows)} SamplingRows were given")
        dev = logits.device
        logits = logits.to(torch.float32)

        # 1. logprobs of the raw logits (before any processing).
        lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            if len(lp_rows) == B:
                raw_logprobs = torch.log_softmax(logits, dim=-1)
            else:
                raw_logprobs = torch.log_softmax(logits[to_device(lp_rows, torch.long, dev)], dim=-1)

        # 2-4. penalties and min_tokens (on a copy: the caller's logits are not modified; a batch that needs
        # none of them makes no copy, one launch less a step, and skips their per-row scans)
        if any(_edits_logits(r) for r in rows):
            logits = logits.clone()
            logits = apply_penalties(logits, rows)
            logits = apply_bias_and_allowed(logits, rows)
            logits = apply_bad_words(logits, rows)
            logits = apply_min_tokens(logits, rows)
            if any(r.grammar is not None for r in rows):
                from compiled_llm.runtime.structured_output import apply_grammar_masks

                logits = apply_grammar_masks(logits, rows)

        # 5. greedy rows take the argmax of the penalised logits.
        token_ids = argmax_rows(logits)

        # 6. random rows.
        rand_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand_rows:
            sub_rows = [rows[i] for i in rand_rows]
            idx = to_device(rand_rows, torch.long, dev)
            sub = logits if len(rand_rows) == B else logits[idx]
            temp = to_device([r.params.temperature for r in sub_rows], torch.float32, dev)
            sub = sub / temp.unsqueeze(1)
            sub = apply_top_k_top_p_min_p(
                sub,
                [r.params.top_k for r in sub_rows],
                [r.params.top_p for r in sub_rows],
                [r.params.min_p for r in sub_rows],
            )
            probs = sub.softmax(dim=-1)
            noise = torch.empty_like(probs)
            global_rows = [j for j, r in enumerate(sub_rows) if r.generator is None]
            if len(global_rows) == len(sub_rows):
                noise.exponential_()
            else:
                if global_rows:
                    g_idx = to_device(global_rows, torch.long, dev)
                    noise[g_idx] = torch.empty(len(global_rows), V, device=dev).exponential_()
                for j, r in enumerate(sub_rows):
                    if r.generator is not None:
                        noise[j].exponential_(generator=r.generator)
            noise.clamp_(min=1e-20)
            sampled = (probs / noise).argmax(dim=-1)
            token_ids = token_ids.index_copy(0, idx, sampled)

        # Logprob bookkeeping on the device; one transfer per quantity when read.
        out = {"token_ids": token_ids}
        if lp_rows:
            lp_idx = to_device(lp_rows, torch.long, dev)
            chosen = token_ids[lp_idx].unsqueeze(1)
            chosen_lp = raw_logprobs.gather(1, chosen)
            out["ranks"] = (raw_logprobs > chosen_lp).sum(dim=-1) + 1
            out["chosen_lp"] = chosen_lp.squeeze(1)
            max_n = max(rows[i].params.logprobs for i in lp_rows)
            if max_n > 0:
                out["top_vals"], out["top_ids"] = raw_logprobs.topk(min(max_n, V), dim=-1)
        batch = SampledBatch(rows, token_ids, out, lp_rows=lp_rows)
        if defer and dev.type == "cuda":
            batch.host_out = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v, non_blocking=True)
                              for k, v in out.items()}
            batch.event = torch.cuda.Event()
            batch.event.record()
        return batch
