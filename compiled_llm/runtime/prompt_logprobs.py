"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's field): each prompt token's logprob given the tokens
before it, and the top-N at its place, as evaluation harnesses ask for (`echo` with `logprobs` on
/v1/completions scores a text).

The logits of position p predict token p + 1, so a chunk that computes positions [start, end) of a prompt of P
tokens gives the entries of tokens start + 1 .. min(end, P - 1). The model runner asks for those hidden rows
after the sampled rows (`spans` says which, in the same order for the runner and the engine) and reduces them
where the logits are made (`summarize`: every rank of a tensor-parallel run takes part in the LM head), PIECE_ROWS
rows of float32 [rows, vocab] logits at a time, to each row's logprob of its next token, that token's rank and
the top-k. Those few numbers go back to the engine packed into rows of the logits' width after the sampled rows
(`pack`), so every executor carries the step's result as one float32 tensor. A prompt is therefore computed in
chunks of the whole token budget, as any other prompt. Only the first sample of a request (its prompt is the
same for all) takes rows; a position it already has (a preempted sequence computed again) takes none. Such a
request steps the engine synchronously, and its prompt is computed in full (no prefix-cache hit: a cached token
has no logits)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compiled_llm.outputs import Logprob

PIECE_ROWS = 256  # logit rows made at a time: 1 GiB of float32 logits per 1,024 rows of a 262,144-token vocabulary


@dataclass
class PromptRows:
    """The last targets.shape[0] of a step's logit rows are prompt rows: each one's next prompt token (targets)
    and the top-k width the step's requests ask for (their largest prompt_logprobs)."""

    targets: torch.Tensor
    k: int


def spans(batch) -> list[tuple[int, int, int]]:
    """(batch index, first position, number of positions) of the logit rows a step's prompt logprobs need, in
    the order the rows follow the sampled ones."""
    out = []
    for i, item in enumerate(batch):
        seq = item.seq
        if seq.params.prompt_logprobs is None or seq.index != 0:
            continue
        start = seq.num_computed_tokens
        lo = max(start, len(seq.prompt_logprobs) - 1)  # positions whose entry is made already
        hi = min(start + item.num_tokens, seq.num_prompt_tokens - 1)
        if hi > lo:
            out.append((i, lo, hi - lo))
    return out


def top_k(batch, step_spans) -> int:
    return max(batch[i].seq.params.prompt_logprobs for i, _, _ in step_spans)


def targets(batch, step_spans) -> list[int]:
    """Each prompt row's next prompt token, in span order."""
    return [t for i, start, n in step_spans for t in batch[i].seq.token_ids[start + 1:start + 1 + n]]


def summarize(logits_of, hidden: torch.Tensor, rows: PromptRows) -> torch.Tensor:
    """float32 [rows, 2 + 2k]: the next token's logprob (log-softmax of the raw logits, as the sampled tokens'
    logprobs) and rank, the top-k logprobs, the top-k ids. logits_of: hidden rows -> logits (the LM head)."""
    k, out = rows.k, []
    for lo in range(0, hidden.shape[0], PIECE_ROWS):
        lp = torch.log_softmax(logits_of(hidden[lo:lo + PIECE_ROWS]).float(), dim=-1)
        chosen = lp.gather(1, rows.targets[lo:lo + PIECE_ROWS].unsqueeze(1))
        parts = [chosen, ((lp > chosen).sum(dim=-1, keepdim=True) + 1).float()]
        if k:
            vals, ids = lp.topk(k, dim=-1)
            parts += [vals, ids.float()]  # ids below 2**24 are exact
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out)


def packed_rows(n: int, k: int, width: int) -> int:
    return math.ceil(n * (2 + 2 * k) / width)


def result_rows(num_rows: int, prompt: PromptRows | None, width: int) -> int:
    """Rows of a step's result for num_rows logit rows asked for: the prompt rows among them come packed."""
    if prompt is None:
        return num_rows
    n = prompt.targets.shape[0]
    return num_rows - n + packed_rows(n, prompt.k, width)


def pack(sampled: torch.Tensor, summary: torch.Tensor) -> torch.Tensor:
    """The sampled rows' logits, then the summary's numbers in rows of the same width (zero-padded)."""
    width = sampled.shape[1]
    flat = summary.reshape(-1)
    rows = packed_rows(summary.shape[0], (summary.shape[1] - 2) // 2, width)
    tail = torch.zeros(rows * width, dtype=sampled.dtype, device=sampled.device)
    tail[:flat.numel()] = flat
    return torch.cat([sampled, tail.view(rows, width)])


def split(out: torch.Tensor, batch, step_spans) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sampled rows' logits, the summary) from a step's packed result."""
    n, k = sum(s[2] for s in step_spans), top_k(batch, step_spans)
    m = out.shape[0] - packed_rows(n, k, out.shape[1])
    return out[:m], out[m:].reshape(-1)[:n * (2 + 2 * k)].view(n, 2 + 2 * k)


def record(batch, step_spans: list[tuple[int, int, int]], summary: torch.Tensor, decode) -> None:
    """Appends each span's entries to its sequence's prompt_logprobs: the next prompt token's logprob and rank,
    and the request's top-N. summary: the step's `summarize` rows, in span order; decode: token id -> text."""
    k = (summary.shape[1] - 2) // 2
    table = summary.tolist()
    offset = 0
    for i, start, n in step_spans:
        seq = batch[i].seq
        want = seq.params.prompt_logprobs
        for j, row in enumerate(table[offset:offset + n]):
            tok = seq.token_ids[start + 1 + j]
            entry = {tok: Logprob(row[0], int(row[1]), decode(tok))}
            for rank in range(1, want + 1):
                tid = int(row[1 + k + rank])
                entry.setdefault(tid, Logprob(row[1 + rank], rank, decode(tid)))
            seq.prompt_logprobs.append(entry)
        offset += n
