"""The layer waist (``oasr.layers``): every model is built from it, never from bare torch layers.

Two checks, both of which fail on a bare ``nn.Linear``:

* **source**: no file under ``oasr/models/`` constructs ``nn.X(...)`` / ``torch.nn.X(...)`` or imports ``X``
  from ``torch.nn`` for a layer ``X`` the waist provides (``oasr.layers.BARE_TORCH_LAYERS``);
* **built**: every registered architecture (``oasr.models.ARCHITECTURES``), built at the tiny size given
  here, holds no module whose type is a bare torch layer. An architecture registered without a tiny
  configuration here fails too (the ratchet: a new architecture cannot skip this test).
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch import nn

import oasr
from oasr.layers import BARE_TORCH_LAYERS
from oasr.models import ARCHITECTURES

MODELS_DIR = pathlib.Path(oasr.__file__).parent / "models"

#: A tiny configuration (keyword arguments of its config class) for every registered architecture.
TINY = {
    "conformer": dict(input_dim=8, hidden_dim=16, num_layers=1, n_head=2, n_kv_head=1, head_dim=8, ffn_dim=16,
                      kernel_size=3, vocab_size=8, chunk_size=2, subsample_channels=8),
    "conv_recurrent": dict(input_dim=8, hidden_dim=16, num_layers=1, kernel_size=2, vocab_size=8),
    "attention_decoder": dict(vocab_size=8, encoder_dim=16, hidden_dim=16, num_layers=1, n_head=2, n_kv_head=1,
                              head_dim=8, ffn_dim=16),
    "nemotron": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                     subsampling_conv_channels=4, num_mel_bins=8, sliding_window=5, default_num_lookahead_tokens=1),
}
TINY.update(getattr(oasr.models, "TINY_CONFIGS", {}))  # architectures whose tiny config needs code to build


def bare_layer_uses(source: str) -> list[str]:
    """``nn.X(``, ``torch.nn.X(`` calls and ``from torch.nn import X`` for the waist's layers, as ``line: text``."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in BARE_TORCH_LAYERS:
            base = ast.unparse(node.func.value)
            if base in ("nn", "torch.nn"):
                found.append(f"{node.lineno}: {base}.{node.func.attr}(...)")
        if isinstance(node, ast.ImportFrom) and node.module in ("torch.nn", "torch.nn.modules"):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name in BARE_TORCH_LAYERS]
    return found


def bare_modules(model: nn.Module) -> list[str]:
    """Submodules whose type is exactly a torch layer the waist replaces."""
    return [f"{name}: {type(m).__module__}.{type(m).__name__}" for name, m in model.named_modules()
            if type(m).__name__ in BARE_TORCH_LAYERS and type(m).__module__.startswith("torch.nn")]


@pytest.mark.parametrize("path", sorted(MODELS_DIR.rglob("*.py")), ids=lambda p: str(p.relative_to(MODELS_DIR)))
def test_no_bare_torch_layer_in_model_sources(path):
    uses = bare_layer_uses(path.read_text())
    assert not uses, f"{path}: build these from oasr.layers instead: {uses}"


def test_the_source_check_catches_a_bare_linear():
    assert bare_layer_uses("from torch import nn\nx = nn.Linear(2, 3)\n") == ["2: nn.Linear(...)"]
    assert bare_layer_uses("import torch\nx = torch.nn.LayerNorm(4)\n") == ["2: torch.nn.LayerNorm(...)"]
    assert bare_layer_uses("from torch.nn import Conv1d\n") == ["1: from torch.nn import Conv1d"]
    assert bare_layer_uses("from oasr import layers\nx = layers.Linear(2, 3)\n") == []


def test_every_registered_architecture_has_a_tiny_config():
    missing = sorted(set(ARCHITECTURES) - set(TINY))
    assert not missing, f"registered architectures without a tiny config in tests/test_layer_waist.py: {missing}"


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_registered_architecture_is_built_from_the_waist(name):
    model_cls, config_cls = ARCHITECTURES[name]
    tiny = TINY[name]
    config = tiny() if callable(tiny) else config_cls(**tiny)
    torch.manual_seed(0)
    model = model_cls(config)
    assert sum(p.numel() for p in model.parameters()) > 0
    bare = bare_modules(model)
    assert not bare, f"{name}: bare torch layers (use oasr.layers): {bare}"


def test_the_built_check_catches_a_bare_linear():
    model = nn.Sequential(oasr.layers.Linear(2, 3), nn.Linear(3, 4))
    assert bare_modules(model) == ["1: torch.nn.modules.linear.Linear"]


def test_waist_layers_load_torch_checkpoints_unchanged():
    """The waist's classes keep torch's parameter names: a bare layer's state dict loads into them exactly."""
    pairs = [(nn.Linear(4, 3), oasr.layers.Linear(4, 3)), (nn.LayerNorm(5), oasr.layers.LayerNorm(5)),
             (nn.Conv1d(6, 6, 3, groups=6), oasr.layers.DepthwiseConv1d(6, 3)), (nn.Embedding(7, 2),
             oasr.layers.Embedding(7, 2)), (nn.LSTM(3, 4, 2), oasr.layers.LSTM(3, 4, 2)),
             (nn.Conv2d(1, 2, 3), oasr.layers.Conv2d(1, 2, 3))]
    for bare, waist in pairs:
        waist.load_state_dict(bare.state_dict(), strict=True)
        assert list(waist.state_dict()) == list(bare.state_dict())
