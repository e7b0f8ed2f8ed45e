"""The transducer's decoder side: prediction network, joint network and their per-stream state.

Built from ``oasr.layers`` with the Hugging Face ``nemotron_asr_streaming`` checkpoint's parameter names
(``encoder_projector.*``, ``decoder.embedding.*``, ``decoder.lstm.*``, ``decoder.decoder_projector.*``,
``joint.head.*``), so the checkpoint's ``state_dict`` loads unchanged:

* ``project_encoder(enc)``: ``encoder_projector(enc)``, once per encoder frame;
* ``predict(tokens, h, c)``: one LSTM step on ``embedding(tokens)`` from ``(h, c)`` ``(layers, B, H)``, then
  ``decoder_projector`` -> ``(g, h', c')``;
* ``joint(e, g)``: ``head(act(e + g))`` -> logits over the whole vocabulary (blank included).

**Per-stream state** (:func:`TransducerSpec.state_specs`, fixed-size slot state, zero-initialised, saved in
sessions): ``rnnt_h`` and ``rnnt_c`` ``(layers, H)`` (slot axis 1) are the LSTM state *before* the
stream's pending token, and ``rnnt_last`` ``(1,)`` int64 is that pending token **plus one**: ``0`` means blank,
the predictor's start symbol. So the zero state is exactly a fresh stream: the predictor starts from the
blank token's embedding at zero LSTM state, as the checkpoint's generation does, and a decode step
computes ``g`` from ``(rnnt_last, rnnt_h, rnnt_c)`` and commits ``(h', c')`` only when it emits a token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from oasr.cache.state_spec import StreamStateSpec
from oasr.layers import LSTM, Embedding, Linear

_ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "silu": nn.functional.silu, "swish": nn.functional.silu,
                "gelu": nn.functional.gelu, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class TransducerSpec:
    """The decoder's geometry, from a checkpoint's ``config.json`` (:meth:`from_hf_config`)."""

    vocab_size: int
    blank_id: int
    encoder_dim: int
    pred_hidden: int
    pred_layers: int
    joint_act: str = "relu"
    max_symbols_per_step: int = 10

    def __post_init__(self):
        if not 0 <= self.blank_id < self.vocab_size:
            raise ValueError(f"TransducerSpec: blank_id {self.blank_id} outside [0, {self.vocab_size})")
        if self.joint_act not in _ACTIVATIONS:
            raise ValueError(f"TransducerSpec: joint activation {self.joint_act!r} not in {sorted(_ACTIVATIONS)}")
        if min(self.encoder_dim, self.pred_hidden, self.pred_layers, self.max_symbols_per_step) <= 0:
            raise ValueError(f"TransducerSpec: sizes and max_symbols_per_step must be > 0, got {self}")

    @classmethod
    def from_hf_config(cls, config: dict) -> TransducerSpec:
        """The spec of a ``nemotron_asr_streaming`` ``config.json`` (a dict); ``ValueError`` naming a missing key."""
        enc = config.get("encoder_config")
        if not isinstance(enc, dict) or "hidden_size" not in enc:
            raise ValueError("config.json: no encoder_config.hidden_size")
        keys = ("vocab_size", "blank_token_id", "decoder_hidden_size", "num_decoder_layers")
        missing = [k for k in keys if k not in config]
        if missing:
            raise ValueError(f"config.json: the transducer lacks {', '.join(missing)}")
        return cls(vocab_size=int(config["vocab_size"]), blank_id=int(config["blank_token_id"]),
                   encoder_dim=int(enc["hidden_size"]), pred_hidden=int(config["decoder_hidden_size"]),
                   pred_layers=int(config["num_decoder_layers"]), joint_act=config.get("hidden_act", "relu"),
                   max_symbols_per_step=int(config.get("max_symbols_per_step", 10)))

    def state_specs(self) -> tuple[StreamStateSpec, ...]:
        """The per-stream slot state (see the module docstring)."""
        hc = (self.pred_layers, self.pred_hidden)
        return (StreamStateSpec("rnnt_h", hc, slot_axis=1), StreamStateSpec("rnnt_c", hc, slot_axis=1),
                StreamStateSpec("rnnt_last", (1,), dtype=torch.int64))


class _PredictionNetwork(nn.Module):
    def __init__(self, spec: TransducerSpec):
        super().__init__()
        self.embedding = Embedding(spec.vocab_size, spec.pred_hidden)
        self.lstm = LSTM(spec.pred_hidden, spec.pred_hidden, num_layers=spec.pred_layers, batch_first=True)
        self.decoder_projector = Linear(spec.pred_hidden, spec.pred_hidden)


class _Joint(nn.Module):
    def __init__(self, spec: TransducerSpec):
        super().__init__()
        self.head = Linear(spec.pred_hidden, spec.vocab_size)


class TransducerHead(nn.Module):
    """Encoder projection, prediction network and joint of one checkpoint (see the module docstring)."""

    def __init__(self, spec: TransducerSpec):
        super().__init__()
        self.spec = spec
        self.encoder_projector = Linear(spec.encoder_dim, spec.pred_hidden)
        self.decoder = _PredictionNetwork(spec)
        self.joint_net = _Joint(spec)
        self._act = _ACTIVATIONS[spec.joint_act]

    # the checkpoint names the joint ``joint.head``; ``joint`` is also the method below
    def state_dict(self, *args, **kwargs):
        """torch's ``state_dict`` under the checkpoint's names (``joint.head.*``)."""
        sd = super().state_dict(*args, **kwargs)
        return type(sd)((k.replace("joint_net.", "joint.", 1), v) for k, v in sd.items())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's ``load_state_dict`` from the checkpoint's names."""
        renamed = {(k.replace("joint.", "joint_net.", 1) if k.startswith("joint.") else k): v
                   for k, v in state_dict.items()}
        return super().load_state_dict(renamed, strict=strict, assign=assign)

    def project_encoder(self, enc: torch.Tensor) -> torch.Tensor:
        """``(..., encoder_dim)`` encoder outputs -> ``(..., pred_hidden)`` joint inputs."""
        return self.encoder_projector(enc)

    def predict(self, last: torch.Tensor, h: torch.Tensor, c: torch.Tensor):
        """One predictor step for ``B`` streams: ``last`` ``(B,)`` int64 in the slot encoding (0 = blank,
        ``k + 1`` = token ``k``), ``h``/``c`` ``(layers, B, H)`` -> ``(g (B, H), h', c')``."""
        tokens = torch.where(last == 0, torch.full_like(last, self.spec.blank_id), last - 1)
        out, (h2, c2) = self.decoder.lstm(self.decoder.embedding(tokens)[:, None, :], (h, c))
        return self.decoder.decoder_projector(out[:, 0]), h2, c2

    def joint(self, e: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``head(act(e + g))``: logits over the vocabulary (blank included)."""
        return self.joint_net.head(self._act(e + g))


def read_hf_transducer(directory) -> TransducerHead:
    """The transducer head of a ``nemotron_asr_streaming`` checkpoint directory, weights loaded (safetensors only).

    One-line ``ValueError`` for a directory without ``config.json``, another model type, a missing weights
    file, or missing, unexpected or wrongly shaped transducer tensors (named).
    """
    d = Path(directory)
    path = d / "config.json"
    if not path.is_file():
        raise ValueError(f"{d}: not a checkpoint directory (no config.json)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    if config.get("model_type") != "nemotron_asr_streaming":
        raise ValueError(f"{path}: model_type {config.get('model_type')!r} is not nemotron_asr_streaming")
    head = TransducerHead(TransducerSpec.from_hf_config(config))
    tensors = _read_safetensors(d, lambda k: not k.startswith("encoder."))
    want = set(head.state_dict())
    missing, unexpected = sorted(want - set(tensors)), sorted(set(tensors) - want)
    if missing or unexpected:
        raise ValueError(f"{d}: transducer tensors missing {missing or '[]'}, unexpected {unexpected or '[]'}")
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    wrong = [f"{k} {tuple(tensors[k].shape)} (config.json implies {shapes[k]})" for k in sorted(shapes)
             if tuple(tensors[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{d}: transducer tensors of the wrong shape: {'; '.join(wrong[:3])}"
                         + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""))
    head.load_state_dict(tensors)
    return head.eval()


def _read_safetensors(d: Path, keep) -> dict:
    from safetensors import SafetensorError, safe_open

    files = sorted(d.glob("model*.safetensors"))
    if not files:
        raise ValueError(f"{d}: no model.safetensors (only safetensors weights are read)")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                    if keep(k):
                        out[k] = sf.get_tensor(k).float()
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{f}: not a readable safetensors file ({exc})") from None
    return out
