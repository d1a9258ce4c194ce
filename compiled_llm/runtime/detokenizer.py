"""Incremental detokenisation and stop-string search.

The detokenizer keeps two offsets into ``all_ids`` (prompt + output ids), in the style of vLLM:

* ``prefix_offset``: start of a short window of already-emitted tokens decoded as context, so
  tokenizers that treat the first token of a sequence specially (SentencePiece's leading-space
  stripping) decode the new tokens the same way they would inside the full sequence;
* ``read_offset``: the first token whose text has not been emitted yet.

Each ``append`` decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the new text
is the difference. While the decoded suffix ends in U+FFFD (an incomplete multi-byte character in
byte-level BPE or byte-fallback tokens) nothing is emitted and the offsets stay put, so the
character comes out whole once its last byte arrives.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# Number of prompt tokens decoded as context in front of the first output token.
INITIAL_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Accepted for vLLM compatibility; transformers>=5 decode() no longer uses it.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.all_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.all_ids)
        self.text = ""
        self.read_offset = len(self.all_ids)
        self.prefix_offset = max(self.read_offset - INITIAL_CONTEXT_TOKENS, 0)
        # A prompt that ends in the middle of a character would make the context text change
        # once the character is completed by output tokens; decode the output on its own then.
        if self.prefix_offset < self.read_offset:
            context = self._decode(self.all_ids[self.prefix_offset : self.read_offset])
            if context.endswith(REPLACEMENT_CHAR):
                self.prefix_offset = self.read_offset

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_ids[self.num_prompt_tokens :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is incomplete)."""
        self.all_ids.append(int(token_id))
        prefix_text = self._decode(self.all_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.all_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.all_ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Emit whatever is still held back (e.g. an incomplete character at the end of generation),
        with U+FFFD for bytes that never formed a character. Call once when the sequence finishes."""
        if self.read_offset >= len(self.all_ids):
            return ""
        prefix_text = self._decode(self.all_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.all_ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.all_ids)
        self.text += delta
        return delta


def find_stop_string(text: str, num_new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
    """Find the earliest stop string in ``text`` that overlaps its last ``num_new_chars`` characters.

    Returns ``(stop, truncate_len)`` where ``text[:truncate_len]`` is the text to keep: up to and
    including the stop string when ``include`` is true, up to (excluding) it otherwise. Ties on the
    start position go to the stop listed first. None when no stop string ends in the new text.
    """
    if num_new_chars <= 0 or not stops:
        return None
    num_new_chars = min(num_new_chars, len(text))
    new_start = len(text) - num_new_chars
    best: tuple[int, str] | None = None
    for stop in stops:
        if not stop:
            continue
        # A match must end after new_start, i.e. start at or after new_start - len(stop) + 1.
        idx = text.find(stop, max(new_start - len(stop) + 1, 0))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return stop, (idx + len(stop) if include else idx)
