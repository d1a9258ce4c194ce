"""The model contract, written once: what every model class serves, and what it may declare on top.

Every model serves `CausalLM` (a Protocol: documentation for readers and type checkers, not checked at
run time). The optional capabilities are small mixins that a class lists in its bases; the runtime,
the multimodal path and the loader ask the helpers below (`supports_pp(model)`, ...), which take a class
or an instance. A capability is therefore declared in one place, at the class header, and found by
type instead of by probing attributes: a model cannot half-declare one by happening to have a method
of the same name, and a new capability is one mixin plus one helper here.

The mixins hold no state and define no `__init__`; the methods they list raise NotImplementedError
until the model implements them (list a mixin before a base class only if it implements them all).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from compiled_llm.ops.attention import AttentionSpec
    from compiled_llm.ops.state import StateSpec


class CausalLM(Protocol):
    """What the runner, the loader and the compiler use of every model."""

    @classmethod
    def config_from_hf(cls, hf: dict) -> Any:
        """The model's config from the checkpoint's config.json (text_config for conditional generation)."""

    def attention_specs(self) -> dict[int, AttentionSpec]:
        """One AttentionSpec per attention layer of this rank (the KV cache is shaped by them)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs) -> torch.Tensor | dict:
        """Hidden states of the flat tokens; the attention op finds the cache in the forward context."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the rows the runner asks for (the last token of each sequence that completed)."""

    def expected_fusions(self) -> dict[int, dict[str, int]]:
        """Per layer of this rank/stage, the matches each fusion pass replaces when the model is compiled
        ({layer: {pass: count}}); the compiler checks them after warm-up (compiler/verify.py)."""

    def hf_to_ours(self, name: str) -> str | tuple | None:
        """Checkpoint tensor name -> parameter name (or (name, index) of a packed slice), None to skip."""

    def skip_missing(self, name: str) -> bool:
        """True for a parameter the checkpoint may lack."""


class SupportsTP:
    """Tensor parallel: the layers are models/parallel_layers.py's, each rank holds its slice of every
    projection and of the vocabulary, and `attention_specs()` gives this rank's head counts."""


class SupportsEP:
    """Expert parallel: the routed experts (parallel_layers.ExpertWeights) are split whole across the
    tensor-parallel group instead of sliced."""


class SupportsPP:
    """Pipeline parallel: a stage builds only its layers (parallel_layers.PPMissingLayer elsewhere),
    `hf_to_ours` returns None for other stages' tensors, and `forward` takes the previous stage's tensors
    (`intermediate=`) and returns a dict of them on every stage but the last. The backbone (`self.model`)
    keeps its stage's layer range in `start_layer` / `end_layer`."""

    def intermediate_shapes(self, num_tokens: int, dtype: torch.dtype) -> dict[str, tuple[tuple, torch.dtype]]:
        """What one stage hands the next, by name: (shape, dtype), fixed per token count."""
        raise NotImplementedError(f"{type(self).__name__} declares SupportsPP but has no intermediate_shapes")

    def stage_layers(self) -> tuple[int, int]:
        """This stage's layers [start, end)."""
        return self.model.start_layer, self.model.end_layer


class SupportsMultiModal:
    """Media prompts (docs/multimodal.md): the checkpoint's processor expands one placeholder per item into
    its soft-token count; the runner embeds the items with `embed_media` and merges them into the text
    embeddings with `embed_with_media`, the placeholder ids replaced by `pad_token_id`."""

    pad_token_id: int
    bidirectional_vision: bool = False  # the tokens of one image (video frame) attend to each other both ways

    def supported_modalities(self) -> set[str]:
        """The modalities this checkpoint's towers take ("image", "audio", "video")."""
        raise NotImplementedError

    def placeholder_token_ids(self) -> dict[str, int]:
        """Modality -> the placeholder token id that the processor repeats once per soft token."""
        raise NotImplementedError

    def embed_media(self, modality: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """One item's soft tokens [placeholders, hidden] from its processor tensors."""
        raise NotImplementedError

    def embed_with_media(self, input_ids: torch.Tensor, rows: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The text embeddings of input_ids with `features` at `rows`."""
        raise NotImplementedError


class HasRecurrentState:
    """Linear-attention layers that keep per-sequence state instead of KV blocks (ops/state.py): the
    runner gives each running sequence a state slot, and prefix caching is off."""

    def state_specs(self) -> dict[int, StateSpec]:
        """One StateSpec per recurrent layer of this rank."""
        raise NotImplementedError


class UsesMRoPE:
    """Multimodal rotary positions: `forward` takes positions [tokens] or [3, tokens]. A multimodal model
    that uses them gives a media prompt its [3, prompt tokens] positions and the delta later tokens add."""

    def prompt_positions(self, ids: list[int], items) -> tuple[torch.Tensor, int]:
        raise NotImplementedError(f"{type(self).__name__} takes no media, so no media prompt positions")


def _declares(model, interface: type) -> bool:
    return issubclass(model if isinstance(model, type) else type(model), interface)


def supports_tp(model) -> bool:
    return _declares(model, SupportsTP)


def supports_ep(model) -> bool:
    return _declares(model, SupportsEP)


def supports_pp(model) -> bool:
    return _declares(model, SupportsPP)


def supports_multimodal(model) -> bool:
    return _declares(model, SupportsMultiModal)


def has_recurrent_state(model) -> bool:
    return _declares(model, HasRecurrentState)


def uses_mrope(model) -> bool:
    return _declares(model, UsesMRoPE)


def recurrent_state_specs(model) -> dict[int, StateSpec]:
    """The model's recurrent-state specs; {} for a model without recurrent layers."""
    return model.state_specs() if has_recurrent_state(model) else {}


def media_modalities(model) -> set[str]:
    """The modalities the model takes; empty for a text-only one."""
    return model.supported_modalities() if supports_multimodal(model) else set()
