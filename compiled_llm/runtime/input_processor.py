"""Admission: a prompt and its SamplingParams -> a Request of n Sequences, checked before anything is queued.

A prompt is text (tokenized here), token ids (taken as given), or a media prompt
{"prompt": text, "multi_modal_data": {...}}, which the checkpoint's own processor turns into token ids and
media items (multimodal/processor.py; the processor is loaded on first use and owned here). Bad input
raises ValueError saying what is wrong. The chat template is rendered here too.

Threads: the engine's processor is used by the engine's thread only. Another thread (the server's event
loop) asks the engine for a copy (`LLMEngine.new_input_processor()`): a tokenizer and a media processor of
its own, and otherwise only what does not change after start-up (the config, the vocabulary size, the
model's media contract). A copy's media processor is locked, so worker threads may share it. A copy can run a
media prompt through the processor ahead of admission (`prepare_media_prompt` -> `ProcessedPrompt`, which
admission takes as it is), so the server keeps that work off the engine thread.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.models.interfaces import media_modalities
from compiled_llm.multimodal.processor import load_processor, placeholder_texts, process_multimodal_prompt
from compiled_llm.runtime.detokenizer import IncrementalDetokenizer
from compiled_llm.runtime.sequence import Request, Sequence
from compiled_llm.sampling_params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class ProcessedPrompt:
    """A media prompt already through the checkpoint's processor (`InputProcessor.prepare_media_prompt`, on any
    thread with its own input processor): the text, the token ids with every placeholder expanded, and the media
    inputs. Admission takes it as it is, so the processor's work (decoding, resizing and normalizing the media,
    hashing the pixels) does not run on the engine thread, where every running request would wait for it."""
    text: str
    token_ids: list[int]
    mm: object  # multimodal.inputs.MultiModalInputs, or None for a prompt without media items


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# apply_chat_template's own arguments: template kwargs may not set them
TEMPLATE_ARGUMENTS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"})


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer, model, vocab_size: int, device: torch.device):
        """model: the one whose media towers admission asks about (rank 0's shard); device: where the
        sampler runs (seeded requests' generators live there)."""
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self._media_processor = None
        self._media_lock = threading.Lock()
        self._placeholders: dict[str, str] | None = None

    def copy(self) -> InputProcessor:
        """An independent processor for another thread: its own tokenizer and media processor."""
        try:
            tokenizer = copy.deepcopy(self.tokenizer)
        except Exception:  # pragma: no cover - depends on the tokenizer class
            tokenizer = self.tokenizer
        return InputProcessor(self.config, tokenizer, self.model, self.vocab_size, self.device)

    # ---- text ----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, continue_final_message: bool = False) -> str:
        """The rendered template. template_kwargs: extra variables for the template (vLLM's chat_template_kwargs,
        e.g. {"enable_thinking": False}); one that names an argument of this call is a ValueError.
        continue_final_message: the last message (an assistant's answer begun by the client) is left open, without
        its end of turn, so that the model goes on writing it (vLLM's and transformers' name); not together with
        add_generation_prompt."""
        if not messages:
            raise ValueError("messages is empty")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                             "add_generation_prompt to false to continue the final message")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
                raise ValueError(f"unknown message role {m.get('role') if isinstance(m, dict) else m!r}")
        clash = sorted(set(template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}")
        kwargs = {**(template_kwargs or {}), **({"chat_template": chat_template} if chat_template else {})}
        if tools:  # OpenAI-style function specs; the template renders them (tool calling)
            kwargs["tools"] = tools
        if not chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; pass one (--chat-template)")
        if continue_final_message:
            kwargs["continue_final_message"] = True
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)

    # ---- media ---------------------------------------------------------------------------------
    def media_placeholders(self) -> dict[str, str]:
        """modality -> the text that stands for one item in a prompt, for the modalities this checkpoint
        takes ({} for a text-only one, or one whose processor cannot be loaded). Computed once."""
        if self._placeholders is None:
            modalities, placeholders = media_modalities(self.model), {}
            if modalities:
                with self._media_lock:
                    try:
                        placeholders = placeholder_texts(self._processor(), modalities)
                    except (ValueError, OSError):
                        placeholders = {}
            self._placeholders = placeholders
        return self._placeholders

    def process_media_prompt(self, prompt: dict):
        """(text, token ids, MultiModalInputs or None) of a media prompt (docs/multimodal.md)."""
        if self.tokenizer is None:
            raise ValueError("this engine was started without a tokenizer: multimodal prompts need one")
        cfg = self.config
        with self._media_lock:
            return process_multimodal_prompt(prompt, self.model, self._processor, self.tokenize,
                                             cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else None)

    def prepare_media_prompt(self, prompt: dict) -> ProcessedPrompt:
        """A media prompt through the processor now, for admission later (ValueError on bad input)."""
        return ProcessedPrompt(*self.process_media_prompt(prompt))

    def _processor(self):
        """The checkpoint's processor, loaded on first use (the caller holds the lock)."""
        if self._media_processor is None:
            self._media_processor = load_processor(self.config.tokenizer or self.config.resolved_model())
        return self._media_processor

    # ---- admission -----------------------------------------------------------------------------
    def process(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams,
                arrival_time: float) -> Request:
        """The request's sequences, each with its detokenizer and, for a seeded request, its generator."""
        text, ids, mm = self._prompt_ids(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if params.truncate_prompt_tokens is not None:
            if mm is not None:
                raise ValueError("truncate_prompt_tokens cannot cut a prompt with media (it could split an item's "
                                 "tokens)")
            cut = params.truncated(ids, self.config.max_model_len)
            if len(cut) < len(ids):  # the text no longer matches what the model sees
                text, ids = None, cut
        if min(ids) < 0 or max(ids) >= self.vocab_size:  # (C loops: a genexpr took ~0.4 ms an 8K prompt)
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        named = [t for t in params.token_ids_named() if t >= self.vocab_size]
        if named:
            raise ValueError(f"token id {named[0]} (stop_token_ids, logit_bias or allowed_token_ids) is out of the "
                             f"vocabulary [0, {self.vocab_size})")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {limit}, which must leave room "
                             "for at least one generated token")
        max_tokens = limit - len(ids) if params.max_tokens is None else min(params.max_tokens, limit - len(ids))
        bad = self.bad_words_token_ids(params.bad_words) if params.bad_words else []
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seq = Sequence(request_id, i, ids, params, max_tokens, arrival_time, gen)
            seq.mm = mm
            seq.bad_words_ids = bad
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                                         params.spaces_between_special_tokens)
            seqs.append(seq)
        return Request(request_id, text, ids, seqs, arrival_time, mm)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """The token sequences SamplingParams.bad_words forbid: each word as written at the start of a text and,
        where the tokenizer merges a leading space into the word's first token, after a space (as vLLM does)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine was started without one")
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenize(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenize(" " + word.lstrip(), add_special_tokens=False)
            out.append(plain)
            if spaced != plain and len(spaced) == len(plain):  # " word" is its own first token, not a space + word
                out.append(spaced)
        return [ids for ids in out if ids]

    def _prompt_ids(self, prompt: str | list[int] | dict | ProcessedPrompt):
        if isinstance(prompt, ProcessedPrompt):
            return prompt.text, list(prompt.token_ids), prompt.mm
        if isinstance(prompt, dict):  # {"prompt": text, "multi_modal_data": {...}} (docs/multimodal.md)
            return self.process_media_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started without a tokenizer: give prompt token ids")
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenize(prompt), None
        return None, list(map(int, prompt)), None
