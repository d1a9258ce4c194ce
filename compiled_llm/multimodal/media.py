"""Media from API requests: data: URLs (base64), allowed http(s) domains, allowed local files; decoded and
checked before the request reaches the engine. Every failure is a MediaError (a ValueError: HTTP 400)."""

from __future__ import annotations

import base64
import binascii
import io
import wave
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

DEFAULT_MAX_MEDIA_BYTES = 20 << 20
DEFAULT_LIMITS = {"image": 8, "audio": 4, "video": 2}


class MediaError(ValueError):
    pass


@dataclass
class MediaPolicy:
    allowed_domains: list[str] = field(default_factory=list)  # http(s) hosts (and their subdomains)
    allowed_local_path: str | None = None  # file:// URLs and paths only under this folder
    limits: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_LIMITS))  # items per prompt
    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    fetch_timeout: float = 10.0

    def check_counts(self, counts: dict[str, int]) -> None:
        for m, n in counts.items():
            limit = self.limits.get(m, DEFAULT_LIMITS.get(m, 0))
            if n > limit:
                raise MediaError(f"too many {m} items in one prompt: {n} (the limit is {limit}; "
                                 "see --limit-mm-per-prompt)")


def parse_limits(value: str | None) -> dict[str, int]:
    """--limit-mm-per-prompt: 'image=2,audio=1' or a JSON object."""
    limits = dict(DEFAULT_LIMITS)
    if not value:
        return limits
    if value.strip().startswith("{"):
        import json

        pairs = json.loads(value).items()
    else:
        pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
    for k, v in pairs:
        k = str(k).strip()
        if k not in DEFAULT_LIMITS:
            raise ValueError(f"--limit-mm-per-prompt: unknown modality {k!r} (use image, audio, video)")
        limits[k] = int(v)
    return limits


def _b64(data: str, what: str, max_bytes: int) -> bytes:
    if len(data) * 3 // 4 > max_bytes:
        raise MediaError(f"the {what} is larger than the {max_bytes}-byte limit")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"the {what} is not valid base64") from None


def fetch_bytes(url: str, policy: MediaPolicy, what: str) -> bytes:
    """The bytes behind a data:, http(s): or file: URL (or a bare local path), under the policy."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"the {what} URL is empty")
    if url.startswith("data:"):
        head, sep, data = url[5:].partition(",")
        if not sep:
            raise MediaError(f"the {what} data URL has no ',' before its data")
        if not head.endswith(";base64"):
            raise MediaError(f"the {what} data URL must be base64 (data:<type>;base64,...)")
        return _b64(data, what, policy.max_bytes)
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        host = (parsed.hostname or "").lower()
        allowed = [x.lower().lstrip(".") for x in policy.allowed_domains]
        if not any(host == d or host.endswith("." + d) for d in allowed):
            raise MediaError(f"{what} URLs from {host or 'this host'} are not allowed (see --allowed-media-domains)")
        import httpx

        try:
            with httpx.stream("GET", url, timeout=policy.fetch_timeout, follow_redirects=False) as r:
                r.raise_for_status()
                chunks, size = [], 0
                for chunk in r.iter_bytes():
                    size += len(chunk)
                    if size > policy.max_bytes:
                        raise MediaError(f"the {what} is larger than the {policy.max_bytes}-byte limit")
                    chunks.append(chunk)
                return b"".join(chunks)
        except httpx.HTTPError as e:
            raise MediaError(f"cannot fetch the {what}: {e}") from None
    if parsed.scheme in ("file", ""):
        if policy.allowed_local_path is None:
            raise MediaError(f"local {what} files are not allowed (see --allowed-local-media-path)")
        path = Path(unquote(parsed.path) if parsed.scheme == "file" else url)
        root = Path(policy.allowed_local_path).resolve()
        try:
            real = path.resolve(strict=True)
        except (OSError, RuntimeError):
            raise MediaError(f"no such local {what} file") from None
        if root != real and root not in real.parents:
            raise MediaError(f"local {what} files must lie under --allowed-local-media-path")
        if not real.is_file():
            raise MediaError(f"the local {what} path is not a file")
        if real.stat().st_size > policy.max_bytes:
            raise MediaError(f"the {what} is larger than the {policy.max_bytes}-byte limit")
        return real.read_bytes()
    raise MediaError(f"unsupported {what} URL scheme {parsed.scheme!r} (use data:, http(s): or file:)")


def decode_image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
        return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise MediaError(f"the image cannot be decoded: {e}") from None


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """A WAV file -> (mono float32 waveform in [-1, 1], sample rate)."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            rate, channels, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError, ValueError) as e:
        raise MediaError(f"the audio cannot be decoded as WAV: {e}") from None
    if width == 1:
        a = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128) / 128
    elif width in (2, 4):
        a = np.frombuffer(raw, dtype=np.int16 if width == 2 else np.int32).astype(np.float32) / (2 ** (8 * width - 1))
    else:
        raise MediaError(f"unsupported WAV sample width {width * 8} bits")
    if channels > 1:
        a = a[: a.size - a.size % channels].reshape(-1, channels).mean(axis=1)
    if a.size == 0 or rate <= 0:
        raise MediaError("the audio is empty")
    return a, rate


def decode_audio(data: bytes, fmt: str | None) -> tuple[np.ndarray, int]:
    if fmt not in (None, "", "wav", "x-wav", "wave"):
        raise MediaError(f"unsupported audio format {fmt!r}: send WAV")
    return decode_wav(data)


def decode_video(data: bytes, max_frames: int = 64) -> np.ndarray:
    """A video -> [frames, H, W, 3] uint8: animated GIF/WebP/PNG through Pillow, other containers through
    PyAV when it is installed."""
    from PIL import Image, ImageSequence, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        frames = [np.asarray(f.convert("RGB")) for _, f in zip(range(max_frames), ImageSequence.Iterator(img))]
        if frames:
            return np.stack(frames)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        pass
    try:
        import av  # noqa: F401
    except ImportError:
        raise MediaError("the video cannot be decoded (animated GIF/WebP are supported; other formats need PyAV)") \
            from None
    try:
        import av

        with av.open(io.BytesIO(data)) as c:
            frames = [f.to_ndarray(format="rgb24") for _, f in zip(range(max_frames), c.decode(video=0))]
    except Exception as e:  # noqa: BLE001 - any container/codec error is the input's fault
        raise MediaError(f"the video cannot be decoded: {e}") from None
    if not frames:
        raise MediaError("the video has no frames")
    return np.stack(frames)


def load_media(modality: str, source, policy: MediaPolicy, fmt: str | None = None):
    """One API media item -> what multi_modal_data takes. source: a URL (image, video) or base64 (audio)."""
    if modality == "image":
        return decode_image(fetch_bytes(source, policy, "image"))
    if modality == "video":
        return decode_video(fetch_bytes(source, policy, "video"))
    if modality == "audio":
        if not isinstance(source, str) or not source:
            raise MediaError("input_audio.data is empty")
        data = fetch_bytes(source, policy, "audio") if source.startswith("data:") else _b64(source, "audio",
                                                                                            policy.max_bytes)
        return decode_audio(data, fmt)
    raise MediaError(f"unknown modality {modality!r}")

