"""After sampling: each sampled token -> its sequence (stop checks, incremental text, logprobs), and each
request -> its cumulative RequestOutput.

A sequence ends with finish_reason "stop" on EOS (unless ignore_eos), on one of its stop token ids or
stop strings (only once min_tokens are out), when its grammar (structured output) has accepted a stop token,
and "length" at max_tokens or max_model_len. The caller frees
an ended sequence's blocks (the scheduler); this module only decides and records.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from compiled_llm.outputs import CompletionOutput, Logprob, RequestOutput
from compiled_llm.runtime.detokenizer import find_stop_string
from compiled_llm.runtime.sampler import SampleResult, SamplingRow
from compiled_llm.runtime.sequence import Request, Sequence

log = logging.getLogger("compiled_llm")


def generation_eos_ids(folder: Path) -> set[int]:
    """End-of-sequence ids from generation_config.json (chat checkpoints add end-of-turn there)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return set()
    eos = json.loads(path.read_text()).get("eos_token_id")
    return {eos} if isinstance(eos, int) else set(eos or [])


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int, sparse: bool):
        """sparse: report the sparse-KV counters in each request's metrics."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.sparse = sparse
        self.generation_tokens_total = 0

    def sampling_row(self, seq: Sequence) -> SamplingRow:
        """What the sampler needs of a sequence: its params, tokens, generator and stop ids (masked while
        fewer than min_tokens are out)."""
        stop_ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            stop_ids |= self.eos_token_ids
        return SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, seq.generator, stop_ids,
                           seq.grammar, seq.bad_words_ids)

    def append_token(self, seq: Sequence, res: SampleResult, now: float) -> bool:
        """Appends the sampled token; True when it ends the sequence (finish_reason and stop_reason set)."""
        p = seq.params
        token = res.token_id
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        if p.logprobs is not None:
            entry = {token: Logprob(res.logprob, res.rank, self.decode_token(token))}
            for rank, (tid, lp) in enumerate(res.top_logprobs, start=1):
                entry.setdefault(tid, Logprob(lp, rank, self.decode_token(tid)))
            seq.logprobs.append(entry)
            seq.cumulative_logprob += res.logprob
        n_out = seq.num_output_tokens
        past_min = n_out >= p.min_tokens
        if seq.grammar is not None and not seq.grammar.accept(token):
            # the mask allowed nothing (e.g. min_tokens holding back the EOS of a complete grammar)
            log.error("request %s: token %d does not follow its grammar; the sequence ends", seq.request_id, token)
            return _finish(seq, "stop", None)
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            return _finish(seq, "stop", None)
        if past_min and token in p.stop_token_ids:
            return _finish(seq, "stop", token)
        if seq.grammar is not None and seq.grammar.is_terminated():  # a stop token completed the grammar
            return _finish(seq, "stop", None)
        new_text = seq.detokenizer.append(token) if seq.detokenizer else ""
        seq.text = seq.detokenizer.text if seq.detokenizer else ""
        if past_min and p.stop and new_text:
            hit = find_stop_string(seq.text, len(new_text), p.stop, p.include_stop_str_in_output)
            if hit:
                seq.text = seq.text[:hit[1]]
                return _finish(seq, "stop", hit[0])
        if n_out >= seq.max_tokens or len(seq) >= self.max_model_len:
            if seq.detokenizer:
                seq.text += seq.detokenizer.flush()
            return _finish(seq, "length", None)
        return False

    def decode_token(self, token: int) -> str | None:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else None

    def output(self, req: Request) -> RequestOutput:
        """The request's output so far (text and token ids cumulative)."""
        outs = []
        for s in req.seqs:
            outs.append(CompletionOutput(
                index=s.index, text=s.text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.params.logprobs is not None else None,
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        first = min((s.first_token_time for s in req.seqs if s.first_token_time), default=None)
        req.metrics.first_token_time = first
        req.metrics.first_scheduled_time = min((s.first_scheduled_time for s in req.seqs if s.first_scheduled_time),
                                               default=None)
        req.metrics.num_cached_tokens = max(s.num_cached_tokens for s in req.seqs)
        if self.sparse:
            req.metrics.sparse_attended_tokens = sum(s.sparse_attended_tokens for s in req.seqs)
            req.metrics.sparse_cached_tokens = sum(s.sparse_cached_tokens for s in req.seqs)
        lead = req.seqs[0]
        prompt_lps = list(lead.prompt_logprobs) if lead.params.prompt_logprobs is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished, req.metrics,
                             num_cached_tokens=req.metrics.num_cached_tokens, prompt_logprobs=prompt_lps)


def _finish(seq: Sequence, reason: str, stop_reason) -> bool:
    seq.finish_reason = reason
    seq.stop_reason = stop_reason
    return True
