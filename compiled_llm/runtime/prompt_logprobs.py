"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's field): each prompt token's logprob given the tokens
before it, and the top-N at its place, as evaluation harnesses ask for (`echo` with `logprobs` on
/v1/completions scores a text).

The logits of position p predict token p + 1, so a chunk that computes positions [start, end) of a prompt of P
tokens gives the entries of tokens start + 1 .. min(end, P - 1). The model runner asks for those rows after the
sampled rows (`spans` says which, in the same order for the runner and the engine), and the engine turns them into
entries on the host once the step is done. Only the first sample of a request (its prompt is the same for all)
takes rows; a position it already has (a preempted sequence computed again) takes none. Such a request steps the
engine synchronously, and its prompt is computed in full (no prefix-cache hit: a cached token has no logits).

The logits are float32 [rows, vocab]: one prefill chunk of max_num_batched_tokens rows of a 262,144-token
vocabulary is 1 GiB per 1,024 rows while the step's entries are made."""

from __future__ import annotations

import torch

from compiled_llm.outputs import Logprob


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


def record(batch, step_spans: list[tuple[int, int, int]], logits: torch.Tensor, decode) -> None:
    """Appends each span's entries to its sequence's prompt_logprobs: the logprob and rank of the next prompt
    token (log-softmax of the raw logits, as the sampled tokens' logprobs) and the top-N. logits: the span rows,
    in span order; decode: token id -> text."""
    offset = 0
    for i, start, n in step_spans:
        seq = batch[i].seq
        rows = logits[offset:offset + n]
        offset += n
        lp = torch.log_softmax(rows.float(), dim=-1)
        target = torch.tensor(seq.token_ids[start + 1:start + 1 + n], device=lp.device).unsqueeze(1)
        chosen = lp.gather(1, target)
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        k = seq.params.prompt_logprobs
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        chosen = chosen.squeeze(1).tolist()
        top_vals = top_vals.tolist() if k else [[]] * n
        top_ids = top_ids.tolist() if k else [[]] * n
        for j in range(n):
            tok = seq.token_ids[start + 1 + j]
            entry = {tok: Logprob(chosen[j], ranks[j], decode(tok))}
            for rank, (tid, val) in enumerate(zip(top_ids[j], top_vals[j]), start=1):
                entry.setdefault(tid, Logprob(val, rank, decode(tid)))
            seq.prompt_logprobs.append(entry)
