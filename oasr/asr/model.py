"""The speech model's shape: encoder and decoder geometry, tokenizer, CMVN and serving defaults in one record.

``AsrSpec`` is what a checkpoint stores besides its tensors (``oasr.asr.checkpoint``) and what the
training recipe starts from. ``build(spec)`` makes the two networks with the project's own
``StreamingConformer`` (the encoder every cache in this library serves) and ``AttentionDecoder``
(the second pass that rescores the CTC n-best).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig
from oasr.models.conformer import ConformerConfig, StreamingConformer
from oasr.tokenizers.char import ALPHABET, CharTokenizer


def _encoder_defaults() -> dict:
    return dict(input_dim=80, hidden_dim=128, num_layers=5, n_head=4, n_kv_head=2, head_dim=64, ffn_dim=512,
                kernel_size=15, chunk_size=32, num_left_chunks=2, subsample_channels=128, subsample_kernels=(5, 3))


def _decoder_defaults() -> dict:
    return dict(hidden_dim=128, num_layers=2, n_head=4, n_kv_head=2, head_dim=64, ffn_dim=512)


@dataclass
class AsrSpec:
    """Everything about the model but its weights. ``encoder`` / ``decoder``: ``ConformerConfig`` /
    ``DecoderConfig`` fields (vocabulary size and encoder width are filled in from the tokenizer and the
    encoder); ``alphabet``: the tokenizer's; ``ctc_weight``: the CTC score's weight when rescoring."""

    encoder: dict = field(default_factory=_encoder_defaults)
    decoder: dict = field(default_factory=_decoder_defaults)
    alphabet: str = ALPHABET
    ctc_weight: float = 0.5

    def __post_init__(self):
        self.encoder = dict(self.encoder)
        if "subsample_kernels" in self.encoder:  # JSON gives a list
            self.encoder["subsample_kernels"] = tuple(self.encoder["subsample_kernels"])
        self.decoder = dict(self.decoder)

    def tokenizer(self) -> CharTokenizer:
        """The character tokenizer of the spec's alphabet."""
        return CharTokenizer(self.alphabet)

    def encoder_config(self, **overrides) -> ConformerConfig:
        """The encoder's ``ConformerConfig`` (vocabulary from the tokenizer; ``overrides`` replace fields)."""
        values = {**self.encoder, "vocab_size": self.tokenizer().vocab_size, **overrides}
        values["subsample_kernels"] = tuple(values.get("subsample_kernels", (5, 3)))
        return ConformerConfig(**values)

    def decoder_config(self) -> DecoderConfig:
        """The attention decoder's ``DecoderConfig``, sized to the tokenizer and the encoder."""
        return DecoderConfig(**{**self.decoder, "vocab_size": self.tokenizer().vocab_size,
                                "encoder_dim": self.encoder["hidden_dim"]})

    def to_dict(self) -> dict:
        """The spec as plain JSON-able values (``from_dict`` reads it back)."""
        d = asdict(self)
        d["encoder"]["subsample_kernels"] = list(d["encoder"]["subsample_kernels"])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AsrSpec:
        """A spec from ``to_dict``'s form (``ValueError`` naming unknown fields)."""
        unknown = set(d) - {"encoder", "decoder", "alphabet", "ctc_weight"}
        if unknown:
            raise ValueError(f"AsrSpec: unknown fields {sorted(unknown)}")
        return cls(**d)


def build(spec: AsrSpec, **encoder_overrides) -> tuple[StreamingConformer, AttentionDecoder]:
    """The encoder and decoder of ``spec`` (seeded random weights until a checkpoint is loaded)."""
    return StreamingConformer(spec.encoder_config(**encoder_overrides)), AttentionDecoder(spec.decoder_config())
