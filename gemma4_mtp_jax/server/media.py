"""Images and audio in chat messages: `image_url` and `input_audio` content parts -> the engine's media.

  1. protocol.py reads each part (`read_part`): a data: URL's or `input_audio`'s base64 is decoded there, an
     http(s) URL is kept for later (fetched only on a server started with --allow-media-fetch). In the message's
     text the part becomes a mark, a Unicode noncharacter that client text may not hold (`MEDIA_MARKS`).
  2. The chat template renders the text; the tokenizer turns each mark into the model's image or audio token
     (chat.TextTokenizer.encode_chat).
  3. `MediaLoader.load`, in a thread (never on the event loop): URLs fetched within their size and time limits,
     images decoded by Pillow, WAV by the standard library (mono, resampled to the feature extractor's rate), the
     encoders run (engine/media.MediaEncoder), the placeholders expanded to the soft-token counts
     (media/placeholders.py). A part that cannot be read fails the request with a 400 naming it
     (`messages[0].content[1]`).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import time
import urllib.request
import wave
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from gemma4_mtp_jax.media.placeholders import expand_placeholders
from gemma4_mtp_jax.server.errors import APIError, bad_request

if TYPE_CHECKING:  # the request parser (protocol.py) imports this module without the engine
    from gemma4_mtp_jax.engine.media import MediaEncoder, MediaItem, PromptMedia

# What a part becomes in its message's text until the tokenizer makes it the model's image or audio token.
MEDIA_MARKS = {"image": "\ufdd0", "audio": "\ufdd1"}
MAX_MEDIA_PARTS = 16  # images and clips per request
MAX_IMAGE_PIXELS = 32 * 2**20  # width x height of a decoded image (Pillow refuses larger ones as bombs too)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_AUDIO_SECONDS = 30.0  # the feature extractor's window
FETCH_CHUNK = 1 << 16  # bytes read at a time from a fetched URL


@dataclasses.dataclass(frozen=True)
class MediaPart:
    """One content part: `where` it is (`messages[0].content[1]`), its kind ("image" | "audio"), and its bytes
    (a data: URL's or input_audio's) or the http(s) URL to fetch them from."""

    where: str
    kind: str
    data: bytes | None = None
    url: str | None = None


@dataclasses.dataclass(frozen=True)
class MediaSettings:
    """--allow-media-fetch and its limits; the soft-token budget of an image (--max-image-tokens)."""

    allow_fetch: bool = False
    fetch_timeout_s: float = 10.0
    max_fetch_bytes: int = 20 * 2**20
    max_image_tokens: int = 280


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the data is not valid base64", "messages") from None


def read_part(part: dict, where: str) -> MediaPart:
    """An `image_url` ({"url": "data:image/...;base64,..." or "http(s)://..."}) or `input_audio` ({"data": base64,
    "format": "wav"}) part, checked and its base64 decoded."""
    if part["type"] == "image_url":
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str):
            raise bad_request(f"{where}: an image_url part needs 'image_url': {{'url': string}}", "messages")
        if url.startswith("data:"):
            head, sep, payload = url.partition(",")
            if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
                raise bad_request(f"{where}: a data: URL must be data:image/<type>;base64,<data>", "messages")
            return MediaPart(where, "image", data=_b64(payload, where))
        if url.startswith(("http://", "https://")):
            return MediaPart(where, "image", url=url)
        raise bad_request(f"{where}: the image URL must be a data: URL or http(s), got {url[:40]!r}", "messages")
    spec = part.get("input_audio")
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise bad_request(f"{where}: an input_audio part needs 'input_audio': {{'data': base64, 'format': 'wav'}}",
                          "messages")
    if spec.get("format", "wav") != "wav":
        raise bad_request(f"{where}: audio format {str(spec.get('format'))[:20]!r} is not supported (wav only)",
                          "messages")
    return MediaPart(where, "audio", data=_b64(spec["data"], where))


def decode_image(data: bytes, where: str) -> np.ndarray:
    """Image file bytes -> uint8 [H, W, 3] (Pillow; the first frame of an animation)."""
    from PIL import Image  # the serving extra's: imported when an image comes

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format not in IMAGE_FORMATS:
                raise bad_request(f"{where}: image format {im.format} is not supported ({', '.join(IMAGE_FORMATS)})",
                                  "messages")
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise bad_request(f"{where}: the image is {im.width}x{im.height} pixels, more than this server's "
                                  f"{MAX_IMAGE_PIXELS}", "messages")
            return np.asarray(im.convert("RGB"), np.uint8)
    except APIError:
        raise
    except Exception as e:  # corrupt or truncated files, decompression bombs, unknown formats
        raise bad_request(f"{where}: the image could not be decoded ({type(e).__name__})", "messages") from None


def decode_wav(data: bytes, rate: int, where: str) -> np.ndarray:
    """WAV bytes (PCM 8/16/32-bit, any channels) -> mono float32 at `rate` Hz (linear interpolation)."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels, src = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except Exception as e:
        raise bad_request(f"{where}: the audio is not a readable WAV file ({type(e).__name__})", "messages") from None
    dtype = {1: np.uint8, 2: np.int16, 4: np.int32}.get(width)
    if dtype is None or src <= 0:
        raise bad_request(f"{where}: WAV of {8 * width}-bit samples at {src} Hz is not supported", "messages")
    x = np.frombuffer(frames[: len(frames) // (width * channels) * width * channels], dtype).astype(np.float32)
    x = (x - 128) / 128 if width == 1 else x / float(np.iinfo(dtype).max)
    x = x.reshape(-1, channels).mean(axis=1)
    if len(x) / src > MAX_AUDIO_SECONDS:
        raise bad_request(f"{where}: the audio lasts {len(x) / src:.1f} s, more than {MAX_AUDIO_SECONDS:.0f} s",
                          "messages")
    if len(x) == 0:
        raise bad_request(f"{where}: the audio is empty", "messages")
    if src != rate:
        t = np.arange(int(round(len(x) * rate / src))) * (src / rate)
        x = np.interp(t, np.arange(len(x)), x).astype(np.float32)
    return x


class MediaLoader:
    """A request's media parts -> (the prompt with its placeholders expanded, the engine's PromptMedia), with
    `encoder` (the target's encoders). Blocking: run it in a thread."""

    def __init__(self, encoder: MediaEncoder, settings: MediaSettings):
        self.encoder, self.settings = encoder, settings

    def load(self, prompt: Sequence[int], parts: Sequence[MediaPart]) -> tuple[list[int], PromptMedia]:
        if len(parts) > MAX_MEDIA_PARTS:
            raise bad_request(f"a request may hold at most {MAX_MEDIA_PARTS} images and audio clips, got "
                              f"{len(parts)}", "messages")
        items: list[MediaItem] = []
        for part in parts:
            data = part.data if part.url is None else self._fetch(part)
            try:
                if part.kind == "image":
                    items.append(self.encoder.image(decode_image(data, part.where)))
                else:
                    rate = self.encoder.audio_config.sampling_rate
                    items.append(self.encoder.audio(decode_wav(data, rate, part.where)))
            except ValueError as e:  # what the model cannot take (no vision tower, no audio tower)
                raise bad_request(f"{part.where}: {e}", "messages") from None
        try:
            ids = expand_placeholders(prompt, self.encoder.config,
                                      [it.num_tokens for it in items if it.kind == "image"],
                                      [it.num_tokens for it in items if it.kind == "audio"])
            return ids, self.encoder.prompt(ids, items)
        except ValueError as e:  # the chat template dropped or repeated a part's place
            raise bad_request(f"the rendered chat does not place every media part: {e}", "messages") from None

    def _fetch(self, part: MediaPart) -> bytes:
        s = self.settings
        if not s.allow_fetch:
            raise bad_request(f"{part.where}: this server does not fetch image URLs (start it with "
                              f"--allow-media-fetch), send a data: URL", "messages")
        deadline = time.monotonic() + s.fetch_timeout_s
        data = bytearray()
        try:
            # The socket timeout bounds each wait; the deadline bounds the whole fetch (a server may trickle).
            with urllib.request.urlopen(part.url, timeout=s.fetch_timeout_s) as r:
                while chunk := r.read(FETCH_CHUNK):
                    data += chunk
                    if len(data) > s.max_fetch_bytes:
                        raise bad_request(f"{part.where}: the image at the URL is larger than {s.max_fetch_bytes} "
                                          f"bytes", "messages")
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"more than {s.fetch_timeout_s} s")
        except APIError:
            raise
        except Exception as e:
            raise bad_request(f"{part.where}: the image URL could not be fetched ({type(e).__name__})",
                              "messages") from None
        return bytes(data)
