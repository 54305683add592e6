"""The runtime's handles on a model pair: a loaded target or assistant is its config, its parameters and its dtype.

These are what the step functions, the compiled programs and the engine take. They live at the model's level, not
with the loaders (`api.py`), so that serving code never imports the checkpoint readers (docs/DESIGN.md, "Layers").
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax

from gemma4_mtp_jax.model.config import AssistantConfig, TextConfig
from gemma4_mtp_jax.model.assistant import Gemma4Assistant
from gemma4_mtp_jax.model.attention import DraftKV
from gemma4_mtp_jax.model.encoders import Gemma4Encoders
from gemma4_mtp_jax.model.media_config import MediaConfig
from gemma4_mtp_jax.model.target import Gemma4Target


def shapes_only(tree: Any) -> bool:
    """Whether `tree` holds shapes alone (jax.ShapeDtypeStruct leaves): parameters to compile for, not to run."""
    return any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree_util.tree_leaves(tree))


@dataclasses.dataclass
class Encoders:
    """A multimodal target's media encoders (vision / audio towers or the unified 12B's embedders): their config
    and parameters (a tree of their own, HF-named; the text model's parameters never include them)."""

    config: MediaConfig
    params: dict
    dtype: Any

    @functools.cached_property
    def module(self) -> Gemma4Encoders:
        return Gemma4Encoders(self.config, self.dtype)

    @functools.cached_property
    def _image(self):
        return jax.jit(lambda p, x, pos: self.module.apply({"params": p}, x, pos, method=Gemma4Encoders.image_features))

    @functools.cached_property
    def _audio(self):
        return jax.jit(lambda p, f, m: self.module.apply({"params": p}, f, m, method=Gemma4Encoders.audio_features))


@dataclasses.dataclass
class Target:
    """A loaded Gemma 4 target: its config, parameters (HF-named tree) and checkpoint directory; `encoders` when
    the checkpoint holds media encoders."""

    config: TextConfig
    params: dict
    dtype: Any
    path: Path
    generation_config: dict
    encoders: Encoders | None = None

    @functools.cached_property
    def module(self) -> Gemma4Target:
        return Gemma4Target(self.config, self.dtype)

    @functools.cached_property
    def _forward(self):
        return jax.jit(lambda p, t, pos: self.module.apply({"params": p}, t, pos))

    @functools.cached_property
    def _forward_embeds(self):
        """The forward over given input embeddings (a prompt with soft tokens) and K/V view (its masks)."""
        return jax.jit(lambda p, t, pos, e, kv: self.module.apply({"params": p}, t, pos, kv, inputs_embeds=e))

    @functools.cached_property
    def _embed(self):
        return jax.jit(lambda p, t: self.module.apply({"params": p}, t, method=Gemma4Target.embed))


@dataclasses.dataclass
class Assistant:
    """A loaded Gemma 4 assistant (MTP drafter)."""

    config: AssistantConfig
    params: dict
    dtype: Any
    path: Path
    generation_config: dict

    @functools.cached_property
    def module(self) -> Gemma4Assistant:
        return Gemma4Assistant(self.config, self.dtype)

    @functools.cached_property
    def _step(self):
        def step(params, embedding, h, by_layer, lengths):
            kv = DraftKV(by_layer, lengths)
            hn, h_next = self.module.apply({"params": params}, embedding, h, kv)
            logits = self.module.apply({"params": params}, hn, method=Gemma4Assistant.logits)
            return logits, h_next, hn

        return jax.jit(step)
