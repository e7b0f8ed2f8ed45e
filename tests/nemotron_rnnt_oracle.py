"""Test-only helpers: tiny random Nemotron streaming checkpoints and transformers' streaming generation.

transformers is the oracle here (the ``dev`` extra); nothing in ``oasr/`` imports it. A checkpoint is a
``NemotronAsrStreamingForRNNT`` with random weights and a small BPE tokenizer trained with the ``tokenizers``
library on a few sentences, saved with ``save_pretrained`` (model and processor) into a directory.

A random model with transformers' default initialisation emits one constant symbol (its outputs are
dominated by biases, so the joint's argmax never changes). :func:`make_checkpoint` re-draws every weight
matrix with unit gain (``randn / sqrt(fan_in)``), zeroes every bias, sets norms to identity, scales the
joint head by 3, and gives the joint head's bias a spread of small random offsets plus ``blank_shift`` on
the blank logit: the argmax then moves with the audio and with the previous token, blanks and tokens mix
(roughly two tokens per encoder frame at the default shift), and ``max_symbols_per_step`` is reached.
"""

from __future__ import annotations

import numpy as np
import torch

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "streaming speech recognition with a transducer",
    "hello world this is a small tokenizer",
    "numbers like one two three four five",
    "caches and slots and pages for every stream",
]

# (hidden, heads, layers, sliding_window, default lookahead, conv kernel, subsampling channels, decoder
#  hidden, decoder layers, max symbols, lookaheads)
CONFIGS = {
    "a": dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, sliding_window=9, conv_kernel_size=5,
              subsampling_conv_channels=8, decoder_hidden_size=24, num_decoder_layers=1, max_symbols_per_step=3,
              lookaheads=[2, 1, 0]),
    "b": dict(hidden_size=48, num_attention_heads=4, num_hidden_layers=1, sliding_window=6, conv_kernel_size=3,
              subsampling_conv_channels=4, decoder_hidden_size=16, num_decoder_layers=2, max_symbols_per_step=2,
              lookaheads=[3, 0]),
    "c": dict(hidden_size=16, num_attention_heads=1, num_hidden_layers=3, sliding_window=12, conv_kernel_size=7,
              subsampling_conv_channels=6, decoder_hidden_size=20, num_decoder_layers=3, max_symbols_per_step=5,
              lookaheads=[1, 4]),
}


def train_tokenizer(vocab_size: int = 40):
    """A tiny BPE (Metaspace, as a SentencePiece model converts) with ``<unk>`` at 0 and ``<blank>`` last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(SENTENCES, trainer)
    tok.add_special_tokens(["<blank>"])
    return tok


def make_checkpoint(path, name: str = "a", seed: int = 0, blank_shift: float = 3.0, num_mel_bins: int = 16,
                    overrides: dict | None = None):
    """Save a tiny random ``NemotronAsrStreamingForRNNT`` + processor under ``path``; returns (model, processor).
    ``overrides``: fields of ``CONFIGS[name]`` replaced (e.g. a head_dim the kernels tile)."""
    from transformers import (
        NemotronAsrStreamingConfig,
        NemotronAsrStreamingEncoderConfig,
        NemotronAsrStreamingFeatureExtractor,
        NemotronAsrStreamingForRNNT,
        NemotronAsrStreamingProcessor,
    )
    from transformers.models.parakeet.tokenization_parakeet import ParakeetTokenizer

    spec = {**CONFIGS[name], **(overrides or {})}
    lookaheads = spec.pop("lookaheads")
    dec = {k: spec.pop(k) for k in ("decoder_hidden_size", "num_decoder_layers", "max_symbols_per_step")}
    tok = train_tokenizer()
    vocab = tok.get_vocab_size()
    torch.manual_seed(seed)
    enc = NemotronAsrStreamingEncoderConfig(intermediate_size=2 * spec["hidden_size"], num_mel_bins=num_mel_bins,
                                            default_num_lookahead_tokens=lookaheads[0], **spec)
    config = NemotronAsrStreamingConfig(encoder_config=enc.to_dict(), vocab_size=vocab, blank_token_id=vocab - 1,
                                        pad_token_id=0, **dec)
    model = NemotronAsrStreamingForRNNT(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():  # unit-gain random weights and no biases: outputs that vary
            if p.ndim == 1:                            # with the input (default init is dominated by biases)
                p.fill_(1.0 if "norm" in pname and pname.endswith("weight") else 0.0)
            else:
                fan_in = p[0].numel() if p.ndim > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
        model.joint.head.weight.mul_(3.0)
        bias = model.joint.head.bias
        bias.copy_(torch.randn(vocab, generator=g) * 0.3)
        bias[vocab - 1] += blank_shift
    model.generation_config.decoder_start_token_id = vocab - 1  # the predictor starts from blank
    model.generation_config.pad_token_id = 0
    hf_tok = ParakeetTokenizer(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>")
    fe = NemotronAsrStreamingFeatureExtractor(feature_size=num_mel_bins)
    processor = NemotronAsrStreamingProcessor(fe, hf_tok, supported_num_lookahead_tokens=lookaheads)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


def clip(index: int, seconds: float | None = None) -> np.ndarray:
    """A clip of the shipped test set (16 kHz float32), optionally cut to ``seconds``."""
    from oasr.asr.audio import load_audio
    from oasr.asr.testset import shipped_testset_dir

    pcm = load_audio(sorted(shipped_testset_dir().glob("*.flac"))[index])
    return pcm if seconds is None else pcm[: int(seconds * 16000)]


def chunked_features(features: torch.Tensor, lookahead: int, subsampling: int = 8):
    """Cut ``(T, F)`` log-mel frames into the streaming chunks (first ``1 + s*r``, then ``s*(r+1)``), the last
    padded with frames of exactly 0.0 (the end-of-stream rule)."""
    first, rest = 1 + subsampling * lookahead, subsampling * (lookahead + 1)
    total = features.shape[0]
    n = first if total <= first else first + -(-(total - first) // rest) * rest
    padded = torch.cat([features, features.new_zeros(n - total, features.shape[1])])
    chunks = [padded[:first]]
    for s in range(first, n, rest):
        chunks.append(padded[s : s + rest])
    return chunks


def oracle_stream(model, features: torch.Tensor, lookahead: int):
    """transformers' streaming generation over the chunks of ``features`` ``(T, F)``.

    Returns ``(tokens, chunk_of_token, encoder_chunks, sequence)``: the non-blank token ids, the chunk index
    whose frames emitted each, the per-chunk encoder outputs ``(frames, hidden)`` (before the transducer's
    encoder projection) and generate's raw sequence (blanks included, as the processor decodes it).
    """
    chunks = chunked_features(features, lookahead, model.config.encoder_config.subsampling_factor)

    def gen():
        for c in chunks:
            yield c[None]

    with torch.no_grad():
        out = model.generate(gen(), num_lookahead_tokens=lookahead)
    seq, dur = out.sequences[0].tolist(), out.durations[0].tolist()
    # encoder frames per chunk, from the oracle's own encoder (caches carried across calls)
    enc_chunks = encoder_chunks(model, chunks, lookahead)
    bounds = np.cumsum([0] + [e.shape[0] for e in enc_chunks])
    blank = model.config.blank_token_id
    tokens, where, frame = [], [], 0
    for tok, d in zip(seq[1:], dur[1:], strict=True):  # sequences[0] is the start blank
        if tok != blank:
            tokens.append(tok)
            where.append(int(np.searchsorted(bounds, frame, side="right") - 1))
        frame += d
    return tokens, where, enc_chunks, out.sequences[0]


def encoder_chunks(model, chunks, lookahead: int):
    """The oracle encoder's outputs chunk by chunk (its own streaming caches), before the projection."""
    outs, cache, pad = [], None, None
    with torch.no_grad():
        for c in chunks:
            o = model.get_audio_features(input_features=c[None], cache=cache, padding_cache=pad,
                                         num_lookahead_tokens=lookahead, use_cache=True, output_attention_mask=False)
            cache, pad = o.cache, o.padding_cache
            outs.append(o.last_hidden_state[0])
    return outs


class HfEncoderStreams:
    """transformers' streaming encoder behind the encoder-streams interface ``TransducerRecognizer`` drives
    (``add_stream``, ``push``, ``end_stream``, ``step``): each stream keeps its own caches; a tick encodes
    one whole chunk of every stream that holds one, one stream at a time."""

    def __init__(self, model, lookahead: int):
        self.model, self.lookahead = model, lookahead
        s = model.config.encoder_config.subsampling_factor
        self.first, self.rest = 1 + s * lookahead, s * (lookahead + 1)
        self.streams = {}

    @classmethod
    def factory(cls, model):
        return lambda directory, lookahead: cls(model, lookahead)

    def add_stream(self, sid):
        self.streams[sid] = {"pending": [], "cache": None, "pad": None, "started": False, "ended": False}

    def push(self, sid, features):
        self.streams[sid]["pending"].append(features)

    def end_stream(self, sid):
        self.streams[sid]["ended"] = True

    def step(self):
        out = {}
        for sid, s in self.streams.items():
            data = torch.cat(s["pending"]) if s["pending"] else torch.zeros(0, 1)
            need = self.rest if s["started"] else self.first
            if data.shape[0] < need:
                continue
            chunk, rest = data[:need], data[need:]
            s["pending"] = [rest] if rest.shape[0] else []
            with torch.no_grad():
                o = self.model.get_audio_features(input_features=chunk[None], cache=s["cache"],
                                                  padding_cache=s["pad"], num_lookahead_tokens=self.lookahead,
                                                  use_cache=True, output_attention_mask=False)
            s["cache"], s["pad"], s["started"] = o.cache, o.padding_cache, True
            out[sid] = o.last_hidden_state[0]
        return out
