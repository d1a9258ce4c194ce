"""Per-request sampling parameters (vLLM field names and defaults)."""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field

# Temperatures below this are treated as greedy (same threshold as vLLM).
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # SamplingParams.structured_output's


class RequestOutputKind(enum.IntEnum):
    """Which outputs a request's steps give (vLLM's names and values). CUMULATIVE: one per step that gave it a token,
    its text and tokens so far; FINAL_ONLY: one, when it ends (what LLM.generate asks for: no per-step copies of a
    growing output). DELTA (vLLM's: only what is new) is refused."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off (-1 is normalised to 0)
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N; 0 = only the sampled token's logprob
    # added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans, 100 forces)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's: words the output may not contain; each word's tokens (written alone and after a space) are banned
    # once the output ends with all of them but the last (runtime/sampler.py apply_bad_words)
    bad_words: list[str] | None = None
    # the prompt's tokens too: each one's logprob given the ones before it, plus the top-N (0: only its own);
    # RequestOutput.prompt_logprobs (runtime/prompt_logprobs.py)
    prompt_logprobs: int | None = None
    # vLLM's: only the prompt's last N tokens are kept (its start is cut); -1: as many as leave room for one
    # generated token (max_model_len - 1). Not for a prompt with media (the cut could split an image's tokens)
    truncate_prompt_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Structured output: {"json": <JSON schema, a dict or its JSON text>}, {"json_object": True} (any JSON object),
    # {"regex": <pattern>}, {"choice": [<string>, ...]} (exactly one of them) or {"grammar": <EBNF>} (xgrammar's
    # GBNF-style EBNF, rule `root`), as vLLM's structured outputs; enforced while decoding
    # (runtime/structured_output.py). A schema given as text is parsed here.
    # Optional "after_token_id": N: the output is free until token N is generated (a thinking model's end of
    # reasoning, `</think>`), and the grammar holds from the token after it.
    structured_output: dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # --- normalisation -------------------------------------------------
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string, a list of strings or None, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers or None, got {self.stop_token_ids!r}"
            )
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self._normalise_structured_output()
        self._verify()

    def _normalise_structured_output(self) -> None:
        so = self.structured_output
        if so is None:
            return
        usage = ("structured_output must be one of {'json': <JSON schema>}, {'json_object': True}, "
                 "{'regex': <pattern>}, {'choice': [<string>, ...]}, {'grammar': <EBNF>}, with an optional "
                 "'after_token_id': <token id>")
        after = {"after_token_id": so["after_token_id"]} if isinstance(so, dict) and "after_token_id" in so else {}
        kinds = [k for k in so if k != "after_token_id"] if isinstance(so, dict) else []
        if not isinstance(so, dict) or len(kinds) != 1 or kinds[0] not in STRUCTURED_KINDS:
            raise ValueError(f"{usage}, got {so!r}")
        if after and not (_is_int(after["after_token_id"]) and after["after_token_id"] >= 0):
            raise ValueError(f"structured_output: after_token_id must be a token id, got {after['after_token_id']!r}")
        kind, value = kinds[0], so[kinds[0]]
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"{usage}, got {so!r}")
            return
        if kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_output: {kind} must be a non-empty string, got {value!r}")
            return
        if kind == "choice":
            if (not isinstance(value, (list, tuple)) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise ValueError(f"structured_output: choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r}")
            self.structured_output = {"choice": list(value), **after}
            return
        schema = so["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ValueError(f"structured_output: the JSON schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_output: the JSON schema must be a JSON object, got {schema!r}")
        self.structured_output = {"json": schema, **after}

    # --- validation --------------------------------------------------------
    def _verify(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        self._check_float("temperature", self.temperature, lo=0.0)
        self._check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, rng="(0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0 or -1 = disabled), got {self.top_k!r}")
        self._check_float("min_p", self.min_p, lo=0.0, hi=1.0, rng="[0, 1]")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            self._check_float(name, getattr(self, name), lo=-2.0, hi=2.0, rng="[-2, 2]")
        self._check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True, rng="> 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        k = self.truncate_prompt_tokens
        if k is not None and not (_is_int(k) and (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only integers >= 0, got {t!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or t < 0:
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
                self._check_float("logit_bias", b, lo=-100.0, hi=100.0)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if not _is_int(self.output_kind) or self.output_kind not in (RequestOutputKind.CUMULATIVE,
                                                                     RequestOutputKind.FINAL_ONLY):
            raise ValueError(f"output_kind must be RequestOutputKind.CUMULATIVE (0) or FINAL_ONLY (2), got "
                             f"{self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids after truncate_prompt_tokens (the last N; -1: max_model_len - 1)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        k = max_model_len - 1 if k == -1 else k
        if k >= max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) must be below max_model_len ({max_model_len}), to leave "
                             "room for a generated token")
        return ids[-k:]

    def token_ids_named(self) -> list[int]:
        """Every token id these params name (stop, bias, allowed), for the engine's vocabulary check."""
        return [*self.stop_token_ids, *(self.logit_bias or ()), *(self.allowed_token_ids or ())]

    @staticmethod
    def _check_float(name, value, lo=None, hi=None, lo_open=False, rng=None) -> None:
        if rng is None:
            rng = f">= {lo:g}" if hi is None else f"[{lo:g}, {hi:g}]"
        ok = _is_number(value) and math.isfinite(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value <= hi
        if not ok:
            raise ValueError(f"{name} must be in {rng}, got {value!r}")

    # --- helpers -------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Deterministic argmax sampling: temperature 0 (below 1e-5) or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)
