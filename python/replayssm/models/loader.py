"""Hugging Face model directories: config.json plus weights in one ``model.safetensors`` or in
shards listed by ``model.safetensors.index.json`` (as ``save_pretrained`` writes them).

Families check names and shapes against their own modules (``check_tensors``), so a missing or
mis-shaped tensor is refused by name before anything is copied into a model.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import torch

__all__ = ["check_tensors", "read_config", "read_model_dir", "read_tensors", "stack_tensors"]

_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a model directory, as a dict."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is not a model directory: it has no config.json") from None


def read_tensors(path: str | os.PathLike, device: Any = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's safetensors file(s), by name, on ``device``."""
    from safetensors.torch import load_file

    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        shards = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, _SINGLE)):
        weight_map, shards = None, [_SINGLE]
    else:
        raise FileNotFoundError(f"{path} has neither {_SINGLE} nor {_INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        file = os.path.join(path, shard)
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file}, listed in {_INDEX}, is missing")
        tensors.update(load_file(file, device=str(torch.device(device))))
    if weight_map is not None:
        listed_missing = sorted(set(weight_map) - set(tensors))
        if listed_missing:
            raise ValueError(f"{_INDEX} lists tensors its shards lack: "
                             f"{', '.join(listed_missing[:5])}")
    return tensors


def read_model_dir(path: str | os.PathLike,
                   device: Any = "cpu") -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, tensors by name) of a Hugging Face model directory."""
    return read_config(path), read_tensors(path, device)


def check_tensors(expected: dict[str, torch.Size], tensors: dict[str, torch.Tensor],
                  ignored: Iterable[str] = ()) -> None:
    """Refuses, naming the first offender, tensors that are missing, mis-shaped, or unknown
    (names starting with a prefix in ``ignored`` are skipped, e.g. heads a model does not use)."""
    ignored = tuple(ignored)
    missing = [name for name in expected if name not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"expected {tuple(shape)}")
    unknown = [name for name in tensors if name not in expected and not name.startswith(ignored)]
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ValueError(f"unexpected tensor {unknown[0]}{more}: not a weight of this model")


def stack_tensors(tensors: dict[str, torch.Tensor], names: list[str],
                  shape: Iterable[int]) -> torch.Tensor:
    """``torch.stack`` of ``tensors[name]`` for ``names`` in order, each of ``shape`` (e.g. a
    checkpoint's one tensor per expert into the [E, ...] tensor a model holds); refuses a
    missing or mis-shaped part by its name, as :func:`check_tensors` does."""
    shape = tuple(shape)
    for name in names:
        if name not in tensors:
            raise ValueError(f"missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                             f"expected {shape}")
    return torch.stack([tensors[name] for name in names])
