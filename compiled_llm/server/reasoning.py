"""Reasoning ("thinking") output on /v1/chat/completions and /v1/responses (`--reasoning-parser`).

A thinking model writes its chain of thought between two markers, then the answer. The parser splits each
choice's text into `reasoning` (`reasoning_content` too: vLLM's and SGLang's names) and `content`; streamed, the
same split arrives as deltas. The formats:

- qwen3 (Qwen3, Qwen3.5/3.6): `<think>` ... `</think>` answer. Qwen3.5's template opens `<think>\\n` in the
  prompt when thinking is on (the output then starts inside the block) and writes an empty block when it is off
  (`chat_template_kwargs: {"enable_thinking": false}`).
- gemma4: `<|channel>thought\\n` ... `<channel|>` answer. Thinking is on when the template puts `<|think|>` in the
  system turn (`chat_template_kwargs: {"enable_thinking": true}`); the markers are special tokens, so the output is
  detokenized with special tokens kept while the parser is on.

Where the output starts is read from the prompt's end (`ReasoningParser.opens_in`): inside an open block, the
text is reasoning until the end marker; otherwise a block counts only at the very start of the output (after
whitespace), and anything else is content. Whitespace around the reasoning and at the start of the content is
dropped (the templates put newlines there). Output cut inside the block (max_tokens) is all reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from compiled_llm.server.errors import APIError
from compiled_llm.server.tool_parsers.stream import partial_marker


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str  # text opening the reasoning
    end: str  # text closing it
    keep_special_tokens: bool = False  # the markers are special tokens of the vocabulary

    def opens_in(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves a reasoning block open (the template opened it)."""
        i = prompt_tail.rfind(self.start)
        return i >= 0 and prompt_tail.find(self.end, i) < 0


PARSERS = {
    "qwen3": ReasoningParser("qwen3", "<think>", "</think>"),
    "gemma4": ReasoningParser("gemma4", "<|channel>thought", "<channel|>", keep_special_tokens=True),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return PARSERS[name]


class ReasoningStream:
    """Generated text -> ("reasoning" | "content", text) pieces as it streams; the non-streamed split is the same
    stream fed everything at once. A tail that could still grow into a marker is held back until it cannot, as is
    whitespace at the end of the reasoning (dropped if the end marker follows)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool):
        self.p = parser
        self.state = "reasoning" if in_reasoning else "start"
        self.buf = ""
        self.saw_reasoning = in_reasoning
        self._ws = ""  # the reasoning's trailing whitespace, held back
        self._lead = {"reasoning": True, "content": True}  # nothing of that kind sent yet: strip leading blanks

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(self.p.start):
                    self.buf, self.state, self.saw_reasoning = head[len(self.p.start):], "reasoning", True
                    continue
                if not final and (not head or self.p.start.startswith(head)):
                    return out  # could still be the opening marker
                self.state = "content"
                continue
            if self.state == "reasoning":
                j = self.buf.find(self.p.end)
                if j >= 0:
                    self._reasoning(self.buf[:j], out, closing=True)
                    self.buf, self.state = self.buf[j + len(self.p.end):], "content"
                    continue
                keep = 0 if final else partial_marker(self.buf, self.p.end)
                self._reasoning(self.buf[:len(self.buf) - keep], out, closing=final)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            text, self.buf = self.buf, ""
            self._emit("content", text, out)
            return out

    def _reasoning(self, text: str, out: list, closing: bool) -> None:
        text, self._ws = self._ws + text, ""
        if not closing:
            body = text.rstrip()
            text, self._ws = body, text[len(body):]
        else:
            text = text.rstrip()
        self._emit("reasoning", text, out)

    def _emit(self, kind: str, text: str, out: list) -> None:
        if self._lead[kind]:
            text = text.lstrip()
        if text:
            self._lead[kind] = False
            out.append((kind, text))


@dataclass
class SplitText:
    reasoning: str | None
    content: str | None
    opened: bool  # the output was in a reasoning block (even an empty one)


def split_reasoning(parser: ReasoningParser, text: str, in_reasoning: bool) -> SplitText:
    """A finished choice's text -> its reasoning and content (None for an empty part)."""
    stream = ReasoningStream(parser, in_reasoning)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return SplitText(reasoning or None, content or None, stream.saw_reasoning)


@dataclass
class ReasoningSetup:
    """What one request's reasoning parser needs: the parser, whether the prompt left a block open, and the end
    marker's token id (None when it is not one token), for counting reasoning tokens and for starting a grammar
    once the reasoning is over."""

    parser: ReasoningParser
    in_reasoning: bool
    end_token_id: int | None
    include: bool  # include_reasoning: false drops the reasoning from the response

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.in_reasoning)

    def split(self, text: str) -> SplitText:
        return split_reasoning(self.parser, text, self.in_reasoning)

    def count_tokens(self, token_ids: list[int], text: str, split: SplitText, encode) -> int:
        """Generated tokens that belong to the reasoning (OpenAI's usage.completion_tokens_details.reasoning_tokens):
        those up to the end marker, markers included; all of them when the output ended inside the block. When
        the end marker is not one token of the vocabulary, the text up to it is tokenized again (`encode`)."""
        if not split.opened:
            return 0
        if self.end_token_id is not None and self.end_token_id in token_ids:
            return token_ids.index(self.end_token_id) + 1
        j = text.find(self.parser.end)
        if j < 0:  # the output ended inside the block
            return len(token_ids)
        return min(len(token_ids), len(encode(text[:j + len(self.parser.end)])))


def single_token_id(tokenizer, text: str) -> int | None:
    """The id of `text` when the vocabulary has it as one token (Qwen's `</think>`, Gemma 4's `<channel|>`)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a tokenizer without encode: no single id
        return None
    return ids[0] if len(ids) == 1 else None


def reasoning_overrides(state) -> dict:
    """SamplingParams settings the server's reasoning parser needs: special tokens kept when they are its markers."""
    parser = state.reasoning_parser
    return {"skip_special_tokens": False} if parser is not None and parser.keep_special_tokens else {}


def reasoning_setup(state, prompt_ids: list[int], include: bool) -> ReasoningSetup | None:
    """The request's ReasoningSetup (None without --reasoning-parser). Whether the prompt left a block open is read
    from its last tokens, detokenized with special tokens kept."""
    parser = state.reasoning_parser
    if parser is None:
        return None
    tail = state.tokenizer.decode(prompt_ids[-64:], skip_special_tokens=False)
    return ReasoningSetup(parser, parser.opens_in(tail), state.reasoning_end_id, include)


def grammar_after_reasoning(setup: ReasoningSetup | None, params, param: str):
    """A constrained request whose prompt opened a reasoning block: the grammar starts after the end marker (the
    model thinks freely, then writes what the format asks for). A 400 when the end marker is not one token."""
    if setup is None or not setup.in_reasoning or params.structured_output is None:
        return params
    if setup.end_token_id is None:
        raise APIError(400, f"structured output after reasoning needs `{setup.parser.end}` to be one token of the "
                            "vocabulary; turn thinking off (chat_template_kwargs: {\"enable_thinking\": false})",
                       param=param)
    return replace(params, structured_output={**params.structured_output, "after_token_id": setup.end_token_id})
