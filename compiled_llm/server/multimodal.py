"""Media content parts of chat and responses requests -> a multimodal engine prompt (docs/multimodal.md).

Each media part becomes the processor's placeholder in the message text; the media are fetched, decoded and
checked here, before the request is queued, so that bad media are a 400 and never reach the engine."""

from __future__ import annotations

from compiled_llm.multimodal.media import MediaError, MediaPolicy, load_media
from compiled_llm.server.errors import APIError

_PART_MODALITY = {"image_url": "image", "input_image": "image", "video_url": "video", "input_video": "video",
                  "input_audio": "audio"}


def is_media_part(part) -> bool:
    return getattr(part, "type", None) in _PART_MODALITY


def part_modality(part) -> str:
    return _PART_MODALITY[part.type]


def placeholder_for(part, placeholders: dict[str, str]) -> str:
    m = part_modality(part)
    if m not in placeholders:
        taken = ", ".join(sorted(placeholders)) or "text only"
        raise APIError(400, f"this model does not take {m} input (it takes: {taken})", param="messages")
    return placeholders[m]


def _source(part) -> tuple[str, object, str | None]:
    m = part_modality(part)
    if part.type == "input_audio":
        return m, part.input_audio.data, part.input_audio.format
    url = getattr(part, "image_url", None) if m == "image" else getattr(part, "video_url", None)
    return m, (url if isinstance(url, str) else url.url), None


def media_prompt(text: str, parts: list, policy: MediaPolicy) -> dict:
    """Rendered prompt text (placeholders in it) plus the decoded media, checked against the policy."""
    counts: dict[str, int] = {}
    for p in parts:
        counts[part_modality(p)] = counts.get(part_modality(p), 0) + 1
    data: dict[str, list] = {}
    try:
        policy.check_counts(counts)
        for p in parts:
            m, source, fmt = _source(p)
            data.setdefault(m, []).append(load_media(m, source, policy, fmt))
    except MediaError as e:
        raise APIError(400, str(e), param="messages") from None
    return {"prompt": text, "multi_modal_data": data, "add_special_tokens": False}


def processed_media_prompt(inputs, prompt: dict):
    """A media prompt through the checkpoint's processor (runtime/input_processor.py ProcessedPrompt: the text,
    the token ids with the placeholders expanded, the media inputs), for a generation or for /tokenize. Runs a
    preprocessing thread's input processor (server/preprocess.py), never the engine's, so that the processor's
    work does not hold up the engine thread; 400 for what admission refuses."""
    try:
        return inputs.prepare_media_prompt(prompt)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
