"""Engine logprobs (one {token_id: Logprob} per generated token) in the three OpenAI formats."""

from __future__ import annotations

import math

from compiled_llm.outputs import Logprob

FLOOR = -9999.0  # JSON has no -Infinity


def _value(lp: Logprob | None) -> float:
    if lp is None or lp.logprob is None or math.isnan(lp.logprob):
        return FLOOR
    return max(float(lp.logprob), FLOOR)


class TokenText:
    """Text of one token id (the engine's decoded_token when it has one), cached."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int, lp: Logprob | None = None) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def token_id_text(token_id: int, lp: Logprob | None = None) -> str:
    """vLLM's return_tokens_as_token_ids: a token as "token_id:<id>" (unambiguous where several ids decode to
    one text, or one decodes to an incomplete character), the form RL trainers read back."""
    return f"token_id:{token_id}"


def _top(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    if n <= 0:
        return []
    return sorted(entry.items(), key=lambda kv: -_value(kv[1]))[:n]


def chat_entries(token_ids: list[int], lps: list[dict[int, Logprob]], top_n: int, text: TokenText) -> list[dict]:
    """Chat: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""
    out = []
    for tid, entry in zip(token_ids, lps):
        tok = text(tid, entry.get(tid))
        out.append({
            "token": tok,
            "logprob": _value(entry.get(tid)),
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := text(i, lp)), "logprob": _value(lp), "bytes": list(t.encode("utf-8"))}
                for i, lp in _top(entry, top_n)
            ],
        })
    return out


def responses_entries(token_ids, lps, top_n, text: TokenText) -> list[dict]:
    """Responses API: same as chat (token, logprob, bytes, top_logprobs)."""
    return chat_entries(token_ids, lps, top_n, text)


def completion_entries(token_ids, lps, top_n: int, text: TokenText, offset: int) -> dict:
    """Completions: {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}. An entry of None (the
    first prompt token under echo: nothing comes before it) gives null logprobs."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, lps):
        tok = text(tid, entry.get(tid) if entry else None)
        out["tokens"].append(tok)
        out["text_offset"].append(offset)
        offset += len(tok)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(entry.get(tid)))
        top = {text(i, lp): _value(lp) for i, lp in _top(entry, top_n)}
        top.setdefault(tok, _value(entry.get(tid)))
        out["top_logprobs"].append(top)
    return out


def top_n_entries(entries: list, n: int) -> list:
    """Each entry cut to its prompt token and the n best (the engine computed the larger of two requests' n)."""
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        items = list(e.items())
        own = items[0]  # the prompt token comes first, then the top-N by rank
        keep = dict(sorted(items[1:], key=lambda kv: kv[1].rank or 0)[:n])
        keep.setdefault(own[0], own[1])
        out.append(keep)
    return out


def vllm_prompt_logprobs(entries: list) -> list[dict | None]:
    """The `prompt_logprobs` field (vLLM's shape): per prompt token None or {token id: {logprob, rank,
    decoded_token}}."""
    return [None if e is None else {str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in entries]
