"""Hybrid decoder models served with replayssm state caches (PyTorch).

    from replayssm import models
    model = models.load("path/to/hf-model-dir", device="cuda", dtype=torch.bfloat16)
    cache = models.ServingCache(model, capacity=64, max_seq_len=4096, mode="replay-fp32")
    slot = cache.allocate()
    logits = model.prefill(cache, slot, prompt)              # [n, vocab]
    logits = model.prefill(cache, slot, more, start=len(prompt))  # continues the slot
    logits = model.step(cache, slot_ids, next_tokens)        # [B, vocab], capturable

``base`` holds the interface and what the families share; each family (``nemotron_h``, ...)
is a module with a config class and a :class:`HybridModel`.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import torch

from .base import CacheLayout, DecodeContext, HybridModel, PrefillContext, ServingCache, StateMode

__all__ = ["CacheLayout", "DecodeContext", "FAMILIES", "HybridModel", "PrefillContext",
           "ServingCache", "StateMode", "family", "load"]

#: config.json's ``model_type`` -> "module:class" of the family's HybridModel.
FAMILIES = {
    "nemotron_h": "nemotron_h:NemotronHModel",
    "qwen3_5_text": "qwen3_5:Qwen35Model",  # what Qwen3_5ForCausalLM.save_pretrained writes
    "qwen3_5": "qwen3_5:Qwen35Model",  # the published checkpoints (text tower under text_config)
    "qwen3_5_moe_text": "qwen3_5:Qwen35MoeModel",  # Qwen3_5MoeForCausalLM.save_pretrained
    "qwen3_5_moe": "qwen3_5:Qwen35MoeModel",  # the published Qwen3.5-MoE checkpoints
    "qwen3_next": "qwen3_next:Qwen3NextModel",  # Qwen3NextForCausalLM (Qwen3-Next-80B-A3B)
}


def family(model_type: str) -> type[HybridModel]:
    """The HybridModel class serving ``model_type``."""
    try:
        module, cls = FAMILIES[model_type].split(":")
    except KeyError:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(sorted(FAMILIES))}") from None
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def load(path_or_config: Any, device: Any = "cpu", dtype: torch.dtype = torch.float32,
         seed: int = 0) -> HybridModel:
    """A model from a Hugging Face model directory (its family picked by config.json's
    ``model_type``), or seeded random weights for a config: a family's config object or a
    config.json-like dict with ``model_type``."""
    if isinstance(path_or_config, (str, os.PathLike)):
        with open(os.path.join(path_or_config, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        return family(model_type).from_pretrained(path_or_config, device=device, dtype=dtype)
    if isinstance(path_or_config, dict):
        model_type = path_or_config.get("model_type")
    else:
        model_type = getattr(path_or_config, "model_type", None)
    return family(model_type).random(path_or_config, seed=seed, device=device, dtype=dtype)
