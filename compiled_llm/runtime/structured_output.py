"""Structured output: a request's constraint (SamplingParams.structured_output: a JSON schema, any JSON object, a
regular expression, a choice of strings or an EBNF grammar) enforced while decoding.

The grammar library is xgrammar (as in vLLM and SGLang), imported on first use: an engine without it serves
every other request, and a constrained one is a StructuredOutputError (a ValueError) naming the package.

- `GrammarBackend` (one per engine, built from its tokenizer): the xgrammar compiler over the tokenizer's
  vocabulary padded to the model's vocabulary size (built on the first constrained request), and the compiled
  grammars, cached by (kind, schema text). A schema xgrammar cannot compile is a StructuredOutputError.
- `GrammarState` (one per sequence): the matcher, advanced by the output processor with each sampled token;
  once it has accepted a stop token (EOS, allowed only where the grammar is complete) the sequence ends.
- `apply_grammar_masks` (the sampler, after penalties and min_tokens): the matchers fill one packed bitmask
  (32 tokens per int32) on the host for the rows that have one, it goes to the logits' device in one copy, and
  the disallowed logits become -inf there (xgrammar's kernel: C++ on CPU, Triton on CUDA; a torch unpack
  wherever the kernel is missing). No Python loop runs over the vocabulary.

The matcher needs the previous token on the host before it can fill the next mask, so a request with a
grammar makes the engine step synchronously while it runs (async_scheduling.needs_host_history), as penalties do.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import threading
from collections import OrderedDict

import torch

from compiled_llm.ops.jit import JitKernel, register_kernel
from compiled_llm.runtime.errors import StructuredOutputError

log = logging.getLogger("compiled_llm")

MISSING = ("structured output needs the `xgrammar` package, which is not installed here "
           "(pip install xgrammar)")
# JSON is written in one layout, `{"a": 1, "b": [2, 3]}` (Python's json.dumps default, as vLLM's
# disable_any_whitespace): with free whitespace between tokens a model can keep writing blanks inside a valid
# prefix until max_tokens, which is a known failure of grammar-constrained decoding.
JSON_LAYOUT = dict(any_whitespace=False, separators=(", ", ": "))


def xgrammar_available() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


def _xgr():
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputError(MISSING) from e
    return xgrammar


def grammar_key(spec: dict) -> tuple[str, str]:
    """(kind, schema text) of a SamplingParams.structured_output: the compiled-grammar cache's key."""
    if "json" in spec:
        return "json", json.dumps(spec["json"], sort_keys=True, separators=(",", ":"))
    if "choice" in spec:
        return "choice", json.dumps(spec["choice"])
    for kind in ("regex", "grammar"):
        if kind in spec:
            return kind, spec[kind]
    return "json_object", ""


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the given strings (vLLM's guided choice): each one a string
    literal (JSON's escapes, which xgrammar's EBNF reads), alternatives of `root`."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


INVALID = {"json": "invalid JSON schema", "regex": "invalid regular expression", "grammar": "invalid EBNF grammar",
           "choice": "invalid choice"}


class GrammarBackend:
    """The engine's grammar compiler and compiled-grammar cache (for one tokenizer and vocabulary size). Safe to
    use from several threads: the server compiles a request's grammar in a worker thread
    (`LLMEngine.prepare_structured_output`), and the engine thread's admission then finds it in the cache. The
    compile runs outside the cache's lock, so a lookup never waits for another request's compile."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()  # the cache and its counters
        self._compiler_lock = threading.Lock()  # building the compiler, once
        self.hits = self.misses = 0

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _xgr()
                if self.tokenizer is None:
                    raise StructuredOutputError("structured output needs a tokenizer; this engine was started "
                                                "without one")
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, spec: dict):
        """The compiled grammar of a structured_output spec (SamplingParams.structured_output)."""
        key = grammar_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
        compiler = self._get_compiler()
        kind, text = key
        try:
            if kind == "json":
                grammar = compiler.compile_json_schema(text, **JSON_LAYOUT)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "grammar":
                grammar = compiler.compile_grammar(text)
            elif kind == "choice":
                grammar = compiler.compile_grammar(choice_grammar(spec["choice"]))
            else:  # any JSON object
                grammar = compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **JSON_LAYOUT)
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError for input it cannot take
            raise StructuredOutputError(f"{INVALID.get(kind, 'invalid constraint')}: {_reason(e)}") from e
        with self._lock:
            self.misses += 1
            self._cache[key] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def new_state(self, grammar, after_token_id: int | None = None) -> GrammarState:
        return GrammarState(_xgr().GrammarMatcher(grammar), after_token_id)


def _reason(e: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    lines = str(e).strip().splitlines() or [type(e).__name__]
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1])[:500]


class GrammarState:
    """One sequence's matcher. With `after_token_id` (a thinking model's end of reasoning) the matcher waits: every
    token is allowed until that one is generated, and the grammar holds from the next."""

    def __init__(self, matcher, after_token_id: int | None = None):
        self.matcher = matcher
        self.waiting_for = after_token_id

    @property
    def active(self) -> bool:
        return self.waiting_for is None

    def accept(self, token_id: int) -> bool:
        if self.waiting_for is not None:
            if token_id == self.waiting_for:
                self.waiting_for = None
            return True
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.waiting_for is None and self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


_kernel_broken: set[str] = set()  # device types where xgrammar's kernel failed once (the torch unpack is used)


def apply_grammar_masks(logits: torch.Tensor, rows) -> torch.Tensor:
    """-inf, in place, on the logits [B, V] of the tokens each constrained row's grammar does not allow now."""
    idx = [i for i, r in enumerate(rows)
           if r.grammar is not None and r.grammar.active and not r.grammar.is_terminated()]
    if not idx:
        return logits
    xgr = _xgr()
    B, V = logits.shape
    bitmask = xgr.allocate_token_bitmask(B, V)  # host int32 [B, ceil(V/32)], all allowed
    for i in idx:
        rows[i].grammar.fill(bitmask, i)
    dev = logits.device
    if dev.type == "cuda":
        bitmask = bitmask.pin_memory().to(dev, non_blocking=True)
    indices = idx if len(idx) < B else None
    if dev.type in ("cpu", "cuda") and dev.type not in _kernel_broken:
        try:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V, indices=indices)
            return logits
        except Exception as e:  # e.g. Triton missing or unable to build the kernel
            log.warning("xgrammar's bitmask kernel failed on %s (%s); masking with torch ops instead", dev.type, e)
            _kernel_broken.add(dev.type)
    return apply_bitmask_torch(logits, bitmask)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The packed bitmask unpacked on the logits' device (bit j of word w allows token 32*w + j); rows left all
    ones are unchanged."""
    B, V = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1).view(B, -1)[:, :V].bool()
    return logits.masked_fill_(~allowed, float("-inf"))


# xgrammar's bitmask kernel is Triton on CUDA, built on its first launch: without a warm-up the first constrained
# request would build it inside an engine step (every running request waiting, and a "JIT compile after warm-up"
# that --jit-monitor error turns into a failed request; read from xgrammar 0.2.9, not yet seen on a GPU). It runs where the sampler's greedy argmax runs on Triton, so
# it rides on that op's provider. Triton specializes the launch on its row count (1, a multiple of 16, other) and
# on whether the rows come as indices (some rows of the batch constrained), so warm-up builds those six.
BITMASK_ROWS = (1, 2, 16)


def _bitmask_keys(facts: dict) -> list:
    if "dtype" not in facts or not xgrammar_available():
        return []
    return [(facts.get("vocab_size", 64), rows, indexed) for rows in BITMASK_ROWS for indexed in (False, True)]


def _bitmask_compile(key, device) -> None:
    vocab, rows, indexed = key
    xgr = _xgr()
    batch = rows + 1 if indexed else rows  # indexed: the last row is unconstrained
    logits = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    bitmask = xgr.allocate_token_bitmask(batch, vocab).to(device)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(range(rows)) if indexed else None)


register_kernel(JitKernel("grammar_bitmask", "argmax_rows", "triton", _bitmask_keys, _bitmask_compile))
