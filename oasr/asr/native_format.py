"""oasr's own format: a directory with one ``model.safetensors`` whose header says ``format: oasr-asr-1``
(``oasr.asr.checkpoint``: the shipped streaming Conformer, its attention decoder and CMVN)."""

from __future__ import annotations

from pathlib import Path

from oasr.checkpoints.registry import CheckpointConverter, Pretrained, register_converter


@register_converter
class NativeConverter(CheckpointConverter):
    source_format = "oasr-asr-1"
    architecture = "streaming_conformer"

    def detect(self, ckpt_dir: Path) -> bool:
        """True when ``model.safetensors``'s header says ``format: oasr-asr-1``."""
        from oasr.asr.checkpoint import FORMAT, read_header

        path = Path(ckpt_dir) / "model.safetensors"
        if not path.is_file():
            return False
        try:
            return read_header(path).get("format") == FORMAT
        except ValueError:
            return False

    def build_config(self, ckpt_dir: Path):
        """The ``AsrSpec`` in the file's header."""
        import json

        from oasr.asr.checkpoint import read_header
        from oasr.asr.model import AsrSpec

        return AsrSpec.from_dict(json.loads(read_header(Path(ckpt_dir) / "model.safetensors")["spec"]))

    def convert(self, ckpt_dir: Path, dtype=None, **options) -> Pretrained:
        """The native file carries its own strict loader (checksum, names, shapes): reuse it whole."""
        from oasr.asr.checkpoint import load_checkpoint

        encoder, decoder, spec, cmvn, info = load_checkpoint(Path(ckpt_dir) / "model.safetensors", **options)
        if dtype is not None:
            encoder.to(dtype)
            decoder.to(dtype)
        return Pretrained(encoder, spec, self.source_format, self.architecture, Path(ckpt_dir),
                          {"decoder": decoder, "cmvn": cmvn, "info": info})
