"""Tensors of a checkpoint directory, read from safetensors only (nothing is unpickled).

A directory holds either one ``model.safetensors`` or shards named by ``model.safetensors.index.json``
(its ``weight_map``: tensor name -> shard file). A ``pytorch_model.bin`` (pickle) is refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def weight_files(ckpt_dir) -> list:
    """The safetensors files holding the directory's weights, in index order (``ValueError`` if none)."""
    d = Path(ckpt_dir)
    if (d / INDEX).is_file():
        try:
            weight_map = json.loads((d / INDEX).read_text())["weight_map"]
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"{d / INDEX}: not a safetensors index ({exc})") from None
        files = list(dict.fromkeys(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise ValueError(f"{d}: the index names shards that are not there: {missing}")
        return [d / f for f in files]
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    pickles = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    hint = f" ({', '.join(pickles)} are pickle files, which oasr does not load: convert them to safetensors)" \
        if pickles else ""
    raise ValueError(f"{d}: no {SINGLE} or {INDEX}{hint}")


def load_tensors(ckpt_dir) -> dict:
    """Every tensor of the directory's safetensors file(s), on the CPU (a name in two shards is refused)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(ckpt_dir):
        try:
            part = load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for a malformed file
            raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise ValueError(f"{path}: tensors also in another shard: {twice[:5]}")
        tensors.update(part)
    return tensors


def read_config(ckpt_dir) -> dict | None:
    """``config.json`` as a dict, or None when the directory has none (``ValueError`` if it is not JSON)."""
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    return value if isinstance(value, dict) else None
