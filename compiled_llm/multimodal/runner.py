"""One step's media: the embeddings of the placeholders in this step's prefill chunks, merged into the text
embeddings, and the bidirectional spans the attention op honours. Only steps that carry media come here.

`plan_media` finds what a step needs (which rows take which item's soft tokens) without running any tower;
`prepare_media` (one process) runs the towers on the sequence's own items. Under parallelism the driver
sends the plan's references and each first-stage rank runs the towers on its registered copy
(runtime/executor/worker.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_llm.ops.attention import BIDIR_SPANS_KEY as BIDIR_KEY


def mrope_batch_positions(batch, flat: torch.Tensor) -> torch.Tensor:
    """[3, tokens] positions of a step where some sequence has M-RoPE prompt positions (a prompt with media):
    its tokens take them (index + delta past the prompt); other sequences' positions repeat on all three."""
    out, offset = [], 0
    for item in batch:
        seq, n = item.seq, item.num_tokens
        mm = seq.mm
        if mm is not None and mm.mrope is not None:
            out.append(mm.positions(seq.num_computed_tokens, seq.num_computed_tokens + n))
        else:
            out.append(flat[offset:offset + n].expand(3, -1))
        offset += n
    return torch.cat(out, dim=1)


def has_media(batch) -> bool:
    return any(getattr(item.seq, "mm", None) is not None and item.seq.num_computed_tokens < item.seq.num_prompt_tokens
               for item in batch)


@dataclass
class MediaPlan:
    input_ids: torch.Tensor  # the step's ids, the pad id at media placeholders
    rows: torch.Tensor  # step rows that take soft tokens, in the order of refs
    refs: list[tuple]  # (sequence, item index, first soft token, end) for each item with tokens in this step
    spans: list[list[tuple[int, int]]]  # bidirectional spans of each sequence that overlap the step
    done: list  # sequences whose prompt ends in this step: their cached soft tokens can go


def plan_media(batch, input_ids: torch.Tensor, pad_id: int) -> MediaPlan:
    rows, refs, spans, done = [], [], [], []
    offset = 0
    for item in batch:
        seq = item.seq
        start = seq.num_computed_tokens
        end = start + item.num_tokens
        mm = getattr(seq, "mm", None)
        seq_spans = []
        if mm is not None and start < seq.num_prompt_tokens:
            for k, media in enumerate(mm.items):
                if media.last < start or media.first >= end:
                    continue
                pos = media.positions  # ascending
                lo, hi = int((pos < start).sum()), int((pos < end).sum())
                if lo < hi:  # (a chunk may end in the text between two video frames)
                    rows.append(pos[lo:hi] - start + offset)
                    refs.append((seq, k, lo, hi))
            seq_spans = [(s, e) for s, e in mm.bidir_spans if s < end and e > start]
            if end >= seq.num_prompt_tokens:
                done.append(seq)
        spans.append(seq_spans)
        offset += item.num_tokens
    dev = input_ids.device
    rows_t = torch.cat(rows).to(dev) if rows else torch.zeros(0, dtype=torch.long, device=dev)
    ids = input_ids.clone()
    if rows_t.numel():
        ids[rows_t] = pad_id
    return MediaPlan(ids, rows_t, refs, spans, done)


def soft_tokens(model, cache: dict, k: int, modality: str, tensors: dict, num_tokens: int) -> torch.Tensor:
    """Item k's soft tokens, from the cache or its tower."""
    emb = cache.get(k)
    if emb is None:
        emb = cache[k] = model.embed_media(modality, tensors)
        if emb.shape[0] != num_tokens:
            raise ValueError(f"{modality} tower gave {emb.shape[0]} soft tokens for {num_tokens} placeholders")
    return emb


def merge(model, input_ids: torch.Tensor, rows: torch.Tensor, feats: list[torch.Tensor]) -> torch.Tensor:
    x = torch.cat(feats).to(input_ids.device) if feats else torch.zeros(0)
    return model.embed_with_media(input_ids, rows, x)


def prepare_media(model, batch, input_ids: torch.Tensor):
    """(input ids with the pad id at media placeholders, merged input embeddings, bidirectional spans per
    sequence) for a batch where some sequence prefills media placeholders."""
    plan = plan_media(batch, input_ids, model.pad_token_id)
    feats = []
    for seq, k, lo, hi in plan.refs:
        it = seq.mm.items[k]
        feats.append(soft_tokens(model, seq.mm.embeds, k, it.modality, it.tensors, it.positions.numel())[lo:hi])
    for seq in plan.done:
        seq.mm.embeds.clear()  # prompt done; a preempted sequence recomputes them
    return plan.input_ids, merge(model, plan.input_ids, plan.rows, feats), plan.spans
