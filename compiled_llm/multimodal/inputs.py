"""What a multimodal sequence carries: its media items (processed tensors, placeholder positions, content
hash) and the spans of tokens that attend to each other in both directions."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


def tensor_hash(modality: str, tensors: dict[str, torch.Tensor]) -> bytes:
    """A hash of one media item's content (its processed tensors: what the towers see)."""
    m = hashlib.sha256(modality.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        m.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        m.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return m.digest()[:16]


@dataclass
class MediaItem:
    modality: str  # "image" | "video" | "audio"
    tensors: dict[str, torch.Tensor]  # the processor's tensors for this item alone (batch dim 1, or frames)
    positions: torch.Tensor  # [tokens] int64: prompt indices of its placeholder tokens, in order
    hash: bytes

    @property
    def first(self) -> int:
        return int(self.positions[0])

    @property
    def last(self) -> int:
        return int(self.positions[-1])


@dataclass
class MultiModalInputs:
    items: list[MediaItem]
    # [start, end) prompt index ranges whose tokens attend to each other both ways (one image, one video
    # frame); the scheduler never splits one across prefill chunks
    bidir_spans: list[tuple[int, int]] = field(default_factory=list)
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # item index -> soft tokens, while prefilling
    # M-RoPE models (Qwen3.5): [3, prompt tokens] positions of the prompt; a later token at index i
    # (generated, or recomputed after a preemption) has position i + mrope_delta on all three components
    mrope: torch.Tensor | None = None
    mrope_delta: int = 0

    def positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] M-RoPE positions of token indices [start, end)."""
        n = self.mrope.shape[1]
        tail = torch.arange(min(max(start, n), end), end) + self.mrope_delta
        return torch.cat([self.mrope[:, start:min(end, n)], tail.expand(3, -1)], dim=1)

    def block_extra(self, block: int, block_size: int) -> bytes:
        """The media hashes of the items whose placeholders fall in this block (prefix-cache key part)."""
        lo, hi = block * block_size, (block + 1) * block_size - 1
        return b"".join(it.hash for it in self.items if it.first <= hi and it.last >= lo)

    def clamp_chunk(self, start: int, num_tokens: int) -> int:
        """Shrink a prefill chunk [start, start + num_tokens) so that it does not end inside a bidirectional
        span; 0 when the chunk starts in (or at) a span that does not fit (wait for a larger budget)."""
        end = start + num_tokens
        for s, e in self.bidir_spans:
            if s < end < e:
                return max(0, s - start) if s > start else 0
        return num_tokens


def clamp_chunk(seq, start: int, num_tokens: int) -> int:
    """Scheduler hook: the chunk size a sequence may take (unchanged for text-only sequences)."""
    mm = getattr(seq, "mm", None)
    if mm is None or not mm.bidir_spans or start >= seq.num_prompt_tokens:
        return num_tokens
    return mm.clamp_chunk(start, num_tokens)


def runs(ids: torch.Tensor, token_id: int) -> list[tuple[int, int]]:
    """[start, end) runs of token_id in a 1-D id tensor."""
    mask = (ids == token_id).tolist()
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out
