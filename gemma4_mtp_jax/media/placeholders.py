"""A chat-templated prompt's media placeholders -> one placeholder token per soft token.

Gemma 4's chat template writes one image token (`<|image|>`) where a message has an image and one audio token
(`<|audio|>`) where it has audio. As transformers' `Gemma4Processor` does, each becomes begin-of-media, as many
placeholders as the encoder gives soft tokens, end-of-media:

    <|image|>  ->  <|image> <|image|> x n <image|>        <|audio|>  ->  <|audio> <|audio|> x m <audio|>

The model then replaces the n (m) placeholders by the soft tokens (`model/multimodal.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gemma4_mtp_jax.model.media_config import MediaConfig


def expand_placeholders(token_ids: Sequence[int], cfg: MediaConfig, image_tokens: Sequence[int] = (),
                        audio_tokens: Sequence[int] = ()) -> list[int]:
    """token_ids with the i-th image placeholder expanded to image_tokens[i] soft-token placeholders (wrapped in
    begin / end-of-image), audio likewise. The number of placeholders must equal the number of media given."""
    counts = {"image": list(image_tokens), "audio": list(audio_tokens)}
    marks = {cfg.image_token_id: ("image", cfg.boi_token_id, cfg.eoi_token_id),
             cfg.audio_token_id: ("audio", cfg.boa_token_id, cfg.eoa_token_id)}
    found = {"image": sum(t == cfg.image_token_id for t in token_ids),
             "audio": sum(t == cfg.audio_token_id for t in token_ids)}
    for what, n in found.items():
        if n != len(counts[what]):
            raise ValueError(f"the prompt has {n} {what} placeholder(s) but {len(counts[what])} {what}(s) were given")
    out: list[int] = []
    used = {"image": 0, "audio": 0}
    for t in token_ids:
        if t not in marks:
            out.append(int(t))
            continue
        what, begin, end = marks[t]
        n = counts[what][used[what]]
        if n <= 0:
            raise ValueError(f"{what} {used[what]} gives {n} soft tokens")
        used[what] += 1
        out += [begin] + [int(t)] * n + [end]
    return out


def media_token_types(token_ids: Sequence[int], cfg: MediaConfig) -> list[int]:
    """transformers' `mm_token_type_ids` of an expanded prompt: 1 for an image placeholder, 2 for a video frame's,
    3 for audio, 0 for text (the begin / end tokens included)."""
    kinds = {cfg.image_token_id: 1, cfg.video_token_id: 2, cfg.audio_token_id: 3}
    return [kinds.get(int(t), 0) for t in token_ids]
