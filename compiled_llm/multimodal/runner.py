"""One step's media: the embeddings of the placeholders in this step's prefill chunks, merged into the text
embeddings, and the bidirectional spans the attention op honours. Only steps that carry media come here."""

from __future__ import annotations

import torch

from compiled_llm.ops.attention import BIDIR_SPANS_KEY as BIDIR_KEY


def has_media(batch) -> bool:
    return any(getattr(item.seq, "mm", None) is not None and item.seq.num_computed_tokens < item.seq.num_prompt_tokens
               for item in batch)


def prepare_media(model, batch, input_ids: torch.Tensor):
    """(input ids with the pad id at media placeholders, merged input embeddings, bidirectional spans per
    sequence) for a batch where some sequence prefills media placeholders."""
    ids = input_ids.clone()
    rows, feats, spans = [], [], []
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
                emb = mm.embeds.get(k)
                if emb is None:
                    emb = mm.embeds[k] = model.embed_media(media.modality, media.tensors)
                    if emb.shape[0] != media.positions.numel():
                        raise ValueError(f"{media.modality} tower gave {emb.shape[0]} soft tokens for "
                                         f"{media.positions.numel()} placeholders")
                sel = (media.positions >= start) & (media.positions < end)
                rows.append(media.positions[sel] - start + offset)
                feats.append(emb[sel.to(emb.device)])
            seq_spans = [(s, e) for s, e in mm.bidir_spans if s < end and e > start]
            if end >= seq.num_prompt_tokens:
                mm.embeds.clear()  # prompt done; a preempted sequence recomputes them
        spans.append(seq_spans)
        offset += item.num_tokens
    dev = input_ids.device
    rows_t = torch.cat(rows).to(dev) if rows else torch.zeros(0, dtype=torch.long, device=dev)
    if rows_t.numel():
        ids[rows_t] = model.pad_token_id
    feats_t = torch.cat(feats).to(dev) if feats else None
    x = model.embed_with_media(ids, rows_t, feats_t if feats_t is not None else torch.zeros(0))
    return ids, x, spans
