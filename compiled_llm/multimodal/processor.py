"""A multimodal prompt -> token ids plus media items, through the checkpoint's own transformers processor.

The prompt is vLLM-shaped: {"prompt": text, "multi_modal_data": {"image": ..., "audio": ..., "video": ...}}.
The text holds one placeholder per item (the processor's image/audio/video token, e.g. "<|image|>"); the
processor expands each into the item's soft-token count and turns the media into tensors. Items are then
split per item (so that each gets its own content hash and embedding) and matched to their placeholder runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from compiled_llm.models.interfaces import media_modalities, uses_mrope
from compiled_llm.multimodal.inputs import MediaItem, MultiModalInputs, runs, tensor_hash

MODALITIES = ("image", "audio", "video")
AUDIO_SAMPLE_RATE = 16_000


def placeholder_texts(proc, modalities: set[str]) -> dict[str, str]:
    """modality -> the text that stands for one item in a prompt, for the modalities the model takes."""
    out = {}
    # Qwen-VL processors expand a bare pad token; the model expects it between vision start/end markers
    start, end = getattr(proc, "vision_start_token", None), getattr(proc, "vision_end_token", None)
    for m in modalities:
        token = getattr(proc, f"{m}_token", None)
        if token:
            out[m] = start + token + end if start and end and m in ("image", "video") else token
    return out


def load_processor(path: str):
    from transformers import AutoProcessor

    folder = Path(path)
    names = ("processor_config.json", "preprocessor_config.json")
    if folder.is_dir() and not any((folder / n).exists() for n in names):
        raise ValueError(f"this checkpoint has no multimodal processor (no processor_config.json in {folder})")
    return AutoProcessor.from_pretrained(path)


def _as_list(x) -> list:
    if x is None:
        return []
    audio_pair = isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], (int, float)) \
        and not isinstance(x[0], (int, float))  # (waveform, sample_rate): one item
    return list(x) if isinstance(x, (list, tuple)) and not audio_pair else [x]


def _resample(audio, target: int = AUDIO_SAMPLE_RATE) -> np.ndarray:
    """An audio item: a 1-D array at 16 kHz, or (array, sample_rate) (linearly resampled)."""
    rate = target
    if isinstance(audio, tuple):
        audio, rate = audio
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim == 2:  # [samples, channels] or [channels, samples]: mix down
        a = a.mean(axis=1 if a.shape[0] > a.shape[1] else 0)
    if a.ndim != 1 or a.size == 0:
        raise ValueError("an audio item must be a non-empty 1-D waveform")
    if int(rate) != target:
        n = max(1, int(round(a.size * target / float(rate))))
        a = np.interp(np.linspace(0, a.size - 1, n), np.arange(a.size), a).astype(np.float32)
    return a


def _video_frames(video) -> np.ndarray:
    """A video item: [frames, H, W, 3] uint8 array, or a list of PIL images / arrays."""
    if isinstance(video, (list, tuple)):
        video = np.stack([np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f) for f in video])
    v = np.asarray(video)
    if v.ndim != 4 or v.shape[0] == 0:
        raise ValueError("a video item must be [frames, height, width, channels] (or a list of frames)")
    return v


def _grid_items(out, ids_t: torch.Tensor, tok: dict[str, int], n_images: int, n_videos: int, check) -> list:
    """Items of a processor that flattens every item's patches into one tensor, with a (t, h, w) grid per
    item (Qwen-VL): each item takes its grid's t*h*w patch rows. A video's frames are separate placeholder
    runs (timestamp text between them): one run per temporal grid step."""
    items = []
    for m, n, pix_key, grid_key in (("image", n_images, "pixel_values", "image_grid_thw"),
                                    ("video", n_videos, "pixel_values_videos", "video_grid_thw")):
        if not n:
            continue
        grids = out[grid_key].reshape(-1, 3)
        check(m, grids.shape[0], n)
        spans = runs(ids_t, tok[m])
        per_item = [int(g[0]) if m == "video" else 1 for g in grids]
        check(m + " frame" if m == "video" else m, len(spans), sum(per_item))
        row = run = 0
        for g, k in zip(grids, per_item):
            size = int(g.prod())
            t = {pix_key: out[pix_key][row:row + size], grid_key: g[None].clone()}
            pos = torch.cat([torch.arange(s, e) for s, e in spans[run:run + k]])
            items.append(MediaItem(m, t, pos, tensor_hash(m, t)))
            row, run = row + size, run + k
    return items


def process_multimodal_prompt(prompt: dict, model, get_processor: Callable, tokenize: Callable,
                              max_chunk_tokens: int | None) -> tuple[str, list[int], MultiModalInputs | None]:
    """Runs the processor; returns (text, token ids, media). ValueError on bad input.
    model: the one whose towers embed the media (its media contract: models/interfaces.py SupportsMultiModal);
    get_processor(): the checkpoint's processor (loaded on first use); tokenize(text, add_special_tokens):
    for a prompt without items; max_chunk_tokens: one step's token budget under chunked prefill, else None."""
    text = prompt.get("prompt")
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(text, str) or not text:
        raise ValueError("a multimodal prompt needs a non-empty 'prompt' string (with one placeholder per item)")
    if not isinstance(data, dict):
        raise ValueError("multi_modal_data must be a dict of modality -> item(s)")
    unknown = set(data) - set(MODALITIES)
    if unknown:
        raise ValueError(f"unknown modality {sorted(unknown)}; use {', '.join(MODALITIES)}")
    images, audios, videos = (_as_list(data.get(m)) for m in MODALITIES)
    if not (images or audios or videos):
        ids = tokenize(text, prompt.get("add_special_tokens", True))
        return text, ids, None
    supported = media_modalities(model)
    for m, items in zip(MODALITIES, (images, audios, videos)):
        if items and m not in supported:
            raise ValueError(f"this model does not take {m} input" +
                             (f" (it takes: {', '.join(sorted(supported))})" if supported else ""))
    proc = get_processor()
    for m, items in zip(MODALITIES, (images, audios, videos)):
        token = getattr(proc, f"{m}_token", None)
        if token and text.count(token) != len(items):
            raise ValueError(f"the prompt has {text.count(token)} {token} placeholder(s) for {len(items)} {m} "
                             "item(s); put one placeholder per item in the text")
    kwargs = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [[im.convert("RGB") if hasattr(im, "convert") else im for im in images]]
    if audios:
        kwargs["audio"] = [_resample(a) for a in audios]
    if videos:
        kwargs["videos"] = [_video_frames(v) for v in videos]
    if not prompt.get("add_special_tokens", True):
        kwargs["add_special_tokens"] = False
    try:
        out = proc(**kwargs)
    except (ValueError, TypeError, IndexError, RuntimeError) as e:
        raise ValueError(f"the processor could not take this prompt: {e}") from None
    ids_t = out["input_ids"][0]
    tok = model.placeholder_token_ids()
    items: list[MediaItem] = []

    def check(m: str, got: int, want: int):
        if got != want:
            raise ValueError(f"the prompt has {got} {m} placeholder(s) for {want} {m} item(s); put one "
                             f"placeholder per item in the text")

    if "image_grid_thw" in out or "video_grid_thw" in out:  # Qwen-VL layout: flat patches plus a grid per item
        items = _grid_items(out, ids_t, tok, len(images), len(videos), check)
        images = videos = []
    if images:
        spans = runs(ids_t, tok["image"])
        check("image", len(spans), len(images))
        for i, (s, e) in enumerate(spans):
            t = {"pixel_values": out["pixel_values"][i:i + 1], "image_position_ids": out["image_position_ids"][i:i + 1]}
            items.append(MediaItem("image", t, torch.arange(s, e), tensor_hash("image", t)))
    if videos:
        spans = runs(ids_t, tok["video"])
        pixels, vpos = out["pixel_values_videos"], out["video_position_ids"]
        if "num_frames_per_video" in out:
            frames = [int(n) for n in torch.as_tensor(out["num_frames_per_video"]).reshape(-1).tolist()]
        else:  # layouts with a video axis: [videos, frames, patches, ...]
            frames = [pixels.shape[1]] * pixels.shape[0]
            pixels, vpos = pixels.flatten(0, 1), vpos.flatten(0, 1)
        check("video frame", len(spans), sum(frames))
        first = 0
        for n in frames:
            t = {"pixel_values_videos": pixels[first:first + n], "video_position_ids": vpos[first:first + n]}
            pos = torch.cat([torch.arange(s, e) for s, e in spans[first:first + n]])
            items.append(MediaItem("video", t, pos, tensor_hash("video", t)))
            first += n
    if audios:
        spans = runs(ids_t, tok["audio"])
        check("audio", len(spans), len(audios))
        for i, (s, e) in enumerate(spans):
            t = {"input_features": out["input_features"][i:i + 1],
                 "input_features_mask": out["input_features_mask"][i:i + 1]}
            items.append(MediaItem("audio", t, torch.arange(s, e), tensor_hash("audio", t)))
    items.sort(key=lambda it: it.first)
    mm = MultiModalInputs(items)
    if uses_mrope(model):  # M-RoPE: [3, tokens] positions for the prompt
        mm.mrope, mm.mrope_delta = model.prompt_positions(ids_t.tolist(), items)
    bidir = mm.bidir_spans
    if model.bidirectional_vision:
        for m in ("image", "video"):
            if m in tok:
                bidir += runs(ids_t, tok[m])
        bidir.sort()
        if max_chunk_tokens is not None and any(e - s > max_chunk_tokens for s, e in bidir):
            raise ValueError(f"an image or video frame takes {max(e - s for s, e in bidir)} tokens, more than one "
                             f"step's budget (max_num_batched_tokens={max_chunk_tokens}); its tokens "
                             "attend to each other both ways, so they must be prefilled in one step")
    return text, ids_t.tolist(), mm
