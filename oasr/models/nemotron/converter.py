"""The Hugging Face ``nemotron_asr_streaming`` directory (``config.json`` + safetensors) -> ``NemotronEncoder``.

Detected by ``config.json``'s ``model_type``: ``nemotron_asr_streaming`` (the whole RNN-T: the
encoder's tensors are ``encoder.*``, the rest, ``decoder.*``, ``joint.*``, ``encoder_projector.*``,
belong to the transducer and are handed on in ``Pretrained.extra["tensors"]``) or
``nemotron_asr_streaming_encoder`` (the encoder alone, no prefix). The encoder's tensors are checked
strictly: every missing and unexpected one named.
"""

from __future__ import annotations

from pathlib import Path

from oasr.checkpoints.registry import CheckpointConverter, check_tensors, register_converter
from oasr.checkpoints.safetensors_dir import load_tensors, read_config
from oasr.models.nemotron.config import NemotronEncoderConfig
from oasr.models.nemotron.encoder import NemotronEncoder

MODEL_TYPES = {"nemotron_asr_streaming": "encoder.", "nemotron_asr_streaming_encoder": ""}
TRANSDUCER_PREFIXES = ("decoder.", "joint.", "encoder_projector.")


@register_converter
class NemotronConverter(CheckpointConverter):
    source_format = "nemotron_asr_streaming"
    architecture = "nemotron_fastconformer"

    def _model_type(self, ckpt_dir: Path):
        try:
            config = read_config(ckpt_dir)
        except ValueError:
            return None
        return None if config is None else config.get("model_type")

    def detect(self, ckpt_dir: Path) -> bool:
        """``config.json``'s ``model_type`` is one of ``MODEL_TYPES``."""
        return self._model_type(ckpt_dir) in MODEL_TYPES

    def build_config(self, ckpt_dir: Path) -> NemotronEncoderConfig:
        """The encoder's config from ``config.json``."""
        try:
            return NemotronEncoderConfig.from_hf_dict(read_config(ckpt_dir))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{Path(ckpt_dir) / 'config.json'}: cannot build the Nemotron encoder ({exc})") from None

    def build_model(self, config: NemotronEncoderConfig, lookahead: int | None = None) -> NemotronEncoder:
        """A ``NemotronEncoder`` serving chunks of ``lookahead + 1`` frames (default: the checkpoint's)."""
        return NemotronEncoder(config, lookahead=lookahead)

    def load_state_dict(self, ckpt_dir: Path, config, model):
        """The encoder's tensors (prefix stripped), checked strictly; the transducer's in ``extra['tensors']``."""
        prefix = MODEL_TYPES[self._model_type(ckpt_dir)]
        tensors = load_tensors(ckpt_dir)
        mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        rest = {k: v for k, v in tensors.items() if not k.startswith(prefix)}
        if prefix:
            unexpected = sorted(k for k in rest if not k.startswith(TRANSDUCER_PREFIXES))
            if unexpected:
                raise ValueError(f"{ckpt_dir}: tensors do not match the model: unexpected {unexpected}")
        check_tensors(ckpt_dir, {f"{k}": v for k, v in model.state_dict().items()}, mine)
        return mine, {"tensors": rest}
