"""Checkpoint formats: ``from_pretrained(DIR)`` picks the converter that detects a local directory.

Known formats: ``oasr-asr-1`` (oasr's own, ``oasr.asr.checkpoint``) and ``nemotron_asr_streaming``
(a Hugging Face directory of NVIDIA's cache-aware FastConformer; ``oasr.models.nemotron.converter``).
See ``registry`` for how to add one.
"""

from oasr.checkpoints.registry import (
    CheckpointConverter,
    Pretrained,
    check_tensors,
    converters,
    detect_format,
    from_pretrained,
    register_converter,
)

__all__ = ["CheckpointConverter", "Pretrained", "check_tensors", "converters", "detect_format", "from_pretrained",
           "register_converter"]
