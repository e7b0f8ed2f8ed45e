"""Models served by the caches: a small streaming Conformer with seeded weights (nothing downloaded)."""

from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig
from oasr.models.conformer import ConformerConfig, DenseState, StreamingConformer, chunk_attention_mask
from oasr.models.conv_recurrent import ConvRecurrentConfig, ConvRecurrentEncoder
from oasr.models.nemotron import NemotronEncoder, NemotronEncoderConfig
from oasr.models.subsampling import CausalSubsampling4
from oasr.models.twins import available_twins, twin_module, twin_ready

#: Every model architecture in this package: name -> (model class, config class). A new architecture is added here
#: and given a tiny configuration in tests/test_layer_waist.py, which fails for an architecture without one.
ARCHITECTURES = {
    "conformer": (StreamingConformer, ConformerConfig),
    "conv_recurrent": (ConvRecurrentEncoder, ConvRecurrentConfig),
    "attention_decoder": (AttentionDecoder, DecoderConfig),
    "nemotron": (NemotronEncoder, NemotronEncoderConfig),
}

__all__ = [
    "ARCHITECTURES",
    "AttentionDecoder",
    "CausalSubsampling4",
    "ConformerConfig",
    "ConvRecurrentConfig",
    "ConvRecurrentEncoder",
    "DecoderConfig",
    "DenseState",
    "NemotronEncoder",
    "NemotronEncoderConfig",
    "StreamingConformer",
    "available_twins",
    "chunk_attention_mask",
    "twin_module",
    "twin_ready",
]
