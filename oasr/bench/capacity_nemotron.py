"""Capacity of a Nemotron streaming transducer with random weights: the live streams each lookahead holds.

``nemotron_capacity(device, model, lookaheads, ...)`` builds a ``TransducerRecognizer`` of the named
configuration with **random weights** (``MODELS``: ``nemotron-0.6b``, the full-size configuration, transformers'
``NemotronAsrStreamingConfig`` defaults; ``nemotron-tiny``, a small one for tests and quick CPU runs), serves it
through ``ServedTransducer`` (the server's stream surface) and, per lookahead, plays N live lanes of synthetic
audio at real time (``oasr.bench.capacity.capacity_row``, the shipped-model capacity's harness: the audio clock in
its own process), N doubled from ``start`` until the p99 chunk latency passes the budget, the recognizer falls
behind, N passes ``max_streams`` or the time budget would be passed. One row per (lookahead, N): the latency
percentiles, per stage the host microseconds per stream-chunk (``ingest``: the piece checked, its log-mel, the
push; ``model``: the encoder's step; ``decode``: the RNN-T greedy decode; ``delivery``), on CUDA the device
microseconds of the model and the decode and ``gpu_busy`` (their CUDA event time over the run's wall time);
``wer`` is None (random weights: the text means nothing). After each lookahead's rows, one ``lookahead a``
row: its chunk in ms, the largest N held, the most ``gpu_busy`` seen, the encoder's execution note.

Nothing here downloads or reads a real checkpoint: the directory ``TransducerRecognizer`` reads (``config.json``,
``processor_config.json``, a word-level ``tokenizer.json``, the transducer head's tensors in
``model.safetensors``) is written by :func:`write_random_checkpoint`; the encoder is built in memory on the
device (:func:`random_encoder_factory`), its weights drawn there. Weights are drawn as the tests' tiny
checkpoints are (unit gain, no biases, identity norms, the joint's blank logit shifted) so the greedy decode
emits a mix of blanks and tokens instead of one constant symbol.

``python -m oasr bench --sections capacity --capacity-model nemotron-0.6b [--lookaheads 13,0]
[--time-budget-s S] [--device cuda]``. The full-size configuration needs a GPU to be useful (about 0.6 G
parameters in fp32, 2.4 GB); on a CPU use ``nemotron-tiny``.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from oasr.asr.transducer_serving import ServedTransducer

# encoder fields (NemotronEncoderConfig), then the transducer's (config.json), then the trained lookaheads
MODELS = {
    "nemotron-0.6b": {
        "encoder": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, intermediate_size=4096,
                        conv_kernel_size=9, subsampling_factor=8, subsampling_conv_channels=256, num_mel_bins=80,
                        sliding_window=71, default_num_lookahead_tokens=13),
        "vocab_size": 1025, "decoder_hidden_size": 640, "num_decoder_layers": 2, "max_symbols_per_step": 10,
        "lookaheads": [13, 6, 1, 0],
    },
    "nemotron-tiny": {
        "encoder": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        conv_kernel_size=5, subsampling_factor=8, subsampling_conv_channels=8, num_mel_bins=16,
                        sliding_window=9, default_num_lookahead_tokens=2),
        "vocab_size": 40, "decoder_hidden_size": 24, "num_decoder_layers": 1, "max_symbols_per_step": 3,
        "lookaheads": [2, 1, 0],
    },
}
BLANK_SHIFT = 3.0  # added to the blank logit's bias: blanks and tokens mix


def _check_model(model: str) -> dict:
    if model not in MODELS:
        raise ValueError(f"nemotron capacity: unknown model {model!r}; choose from {', '.join(MODELS)}")
    return MODELS[model]


def _redraw(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Unit-gain weights (``randn / sqrt(fan_in)``), zero biases, identity norms; in place, on the module's device."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=generator, device=generator.device) / fan_in**0.5)


def write_random_checkpoint(directory, model: str = "nemotron-tiny", seed: int = 0) -> Path:
    """Write the checkpoint directory ``TransducerRecognizer`` reads for ``model`` (module docstring) with a random
    transducer head; the encoder's tensors are not written (:func:`random_encoder_factory` draws them). Returns
    the directory. ``ValueError`` for an unknown model."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    from oasr.models.transducer import TransducerHead, TransducerSpec

    spec = _check_model(model)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    vocab = spec["vocab_size"]
    config = {"model_type": "nemotron_asr_streaming", "vocab_size": vocab, "blank_token_id": vocab - 1,
              "pad_token_id": 0, "decoder_hidden_size": spec["decoder_hidden_size"],
              "num_decoder_layers": spec["num_decoder_layers"], "hidden_act": "relu",
              "max_symbols_per_step": spec["max_symbols_per_step"],
              "encoder_config": {**spec["encoder"], "model_type": "nemotron_asr_streaming_encoder"}}
    (d / "config.json").write_text(json.dumps(config, indent=1))
    extractor = {"feature_extractor_type": "NemotronAsrStreamingFeatureExtractor",
                 "feature_size": spec["encoder"]["num_mel_bins"], "sampling_rate": 16000, "hop_length": 160,
                 "n_fft": 512, "win_length": 400, "preemphasis": 0.97}
    (d / "processor_config.json").write_text(json.dumps(
        {"supported_num_lookahead_tokens": spec["lookaheads"], "default_num_lookahead_tokens": spec["lookaheads"][0],
         "blank_token": "<blank>", "feature_extractor": extractor}, indent=1))
    words = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab - 1)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.add_special_tokens(["<blank>"])  # id vocab - 1
    tok.save(str(d / "tokenizer.json"))
    head = TransducerHead(TransducerSpec.from_hf_config(config))
    g = torch.Generator().manual_seed(seed)
    _redraw(head, g)
    with torch.no_grad():
        head.joint_net.head.weight.mul_(3.0)
        bias = head.joint_net.head.bias
        bias.copy_(torch.randn(vocab, generator=g) * 0.3)
        bias[vocab - 1] += BLANK_SHIFT
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(d / "model.safetensors"))
    return d


def random_encoder_factory(model: str, device="cpu", max_batch_size: int = 8, seed: int = 0,
                           kv_cache_dtype: str | None = None):
    """``factory(directory, lookahead)`` for ``TransducerRecognizer(encoder_factory=)``: the ``model``'s
    ``NemotronEncoder`` built on ``device`` with random weights (drawn there), served by an
    ``EncoderStreamingEngine`` of ``max_batch_size`` slots (CUDA graphs on a GPU, as ``oasr_encoder_streams``)."""
    from oasr.engine.encoder_streams import EncoderStreamingEngine
    from oasr.models.nemotron.config import NemotronEncoderConfig
    from oasr.models.nemotron.encoder import NemotronEncoder

    spec = _check_model(model)
    dev = torch.device(device)

    def factory(directory, lookahead: int):
        with dev:  # parameters allocated on the device; .to moves anything the constructor made on the host
            encoder = NemotronEncoder(NemotronEncoderConfig(**spec["encoder"]), lookahead=lookahead).to(dev)
        _redraw(encoder, torch.Generator(device=dev).manual_seed(seed))
        config = encoder.cache_config(max_batch_size=max_batch_size, kv_cache_dtype=kv_cache_dtype, device=dev)
        return EncoderStreamingEngine(encoder, config, twin="fast")

    return factory


def synthetic_audio(count: int = 8, seconds: float = 3.0, seed: int = 0) -> list:
    """``count`` clips of ``seconds`` of 16 kHz float32 noise under a slow random envelope (syllable-like bursts):
    audio the front end and the encoder treat as any other; the same for a seed."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    clips = []
    for i in range(count):
        length = n + int(rng.integers(-n // 4, n // 4 + 1)) if i else n
        envelope = np.repeat(rng.uniform(0.02, 0.5, size=length // 1600 + 1), 1600)[:length]
        clips.append((rng.standard_normal(length) * envelope).astype(np.float32).clip(-1.0, 1.0))
    return clips


class LiveTransducer(ServedTransducer):
    """A ``ServedTransducer`` that gives a finished stream's slot back in the tick that finished it (what the
    server does after taking the transcript), so lanes can open their next clip's stream."""

    def step(self, on_error=None) -> list:
        """``ServedTransducer.step``, each finished stream then forgotten (``engine.cancel``)."""
        done = super().step(on_error)
        for transcript in done:
            self.engine.cancel(transcript.id)
        return done


def build_recognizer(model: str, lookahead: int, device="cpu", max_streams: int = 8, directory=None, seed: int = 0):
    """A ``LiveTransducer`` of ``model`` with random weights at ``lookahead`` (one of the model's), ``max_streams``
    slots on ``device``; ``directory`` holds its written checkpoint (default: a fresh temporary one)."""
    import tempfile

    from oasr.asr.transducer import TransducerRecognizer

    spec = _check_model(model)
    if lookahead not in spec["lookaheads"]:
        raise ValueError(f"nemotron capacity: lookahead {lookahead} is not one of {model}'s "
                         f"{', '.join(map(str, spec['lookaheads']))}")
    d = write_random_checkpoint(directory or tempfile.mkdtemp(prefix="oasr-nemotron-"), model, seed)
    factory = random_encoder_factory(model, device, max_streams, seed)
    rec = TransducerRecognizer(d, encoder_factory=factory, lookahead=lookahead, max_batch_size=max_streams,
                               device=device)
    return LiveTransducer(rec)


def _lookahead_rows(model, a, device, slots, audio, budget_ms, start, max_streams, seconds, time_budget_s, t_start,
                    progress, rows: list, summary: dict) -> None:
    """One lookahead's runs (``nemotron_capacity``): its rows appended to ``rows``, ``summary`` filled in as it goes
    (so an exception leaves what was measured)."""
    from oasr.bench.capacity import capacity_row

    built = time.perf_counter()
    rec = build_recognizer(model, a, device, slots)
    chunk_s = rec.rec.lookaheads.latency_seconds(a)
    summary.update(chunk_ms=chunk_s * 1e3, note=rec.engine.execution_note)
    capacity_row(rec, audio, None, min(start, 8), 2.0, budget_ms, chunk_s)  # warm-up: first-use costs
    summary["setup_s"] = time.perf_counter() - built
    n, last_run = start, 0.0
    while True:
        if n > max_streams:
            summary["stopped"] = "max_streams"
            return
        if time_budget_s is not None and time.perf_counter() - t_start + 2 * last_run > time_budget_s:
            summary["stopped"] = "time budget"
            return
        began = time.perf_counter()
        row = capacity_row(rec, audio, None, n, seconds, budget_ms, chunk_s)
        last_run = time.perf_counter() - began
        row.update(case=f"lookahead {a}, {n} live streams", model=model, lookahead=a, chunk_ms=chunk_s * 1e3)
        rows.append(row)
        if row.get("gpu_busy") is not None:
            summary["gpu_busy_max"] = max(summary["gpu_busy_max"] or 0.0, row["gpu_busy"])
        if progress is not None:
            progress(f"capacity {model} lookahead {a}: {n} streams p99 {row['latency_p99_ms']:.0f} ms, "
                     f"held={row['held']}" + (f", gpu busy {row['gpu_busy']:.0%}" if "gpu_busy" in row else ""))
        if not row["held"]:
            summary["stopped"] = "over budget"
            return
        summary["max_streams_held"], n = n, 2 * n


def nemotron_capacity(device: str = "cpu", model: str = "nemotron-tiny", lookaheads=None,
                      latency_budget_ms: float = 250.0, start: int = 16, max_streams: int = 1024,
                      seconds: float = 8.0, time_budget_s: float | None = None, progress=print) -> list[dict]:
    """Per lookahead (default all of the model's), double N from ``start`` while N live streams hold the budget;
    the rows (module docstring). ``time_budget_s``: no new run starts once the time spent, plus the last run's
    time doubled, would pass it, and no lookahead starts once the time spent plus the last one's set-up would
    (the rows so far are returned; ``stopped`` on the lookahead row says why). A ``RuntimeError`` or
    ``MemoryError`` inside one lookahead (e.g. out of device memory at a wide cohort) ends that lookahead:
    its rows so far are kept and ``stopped`` names the error; the next lookahead runs.
    ``ValueError`` for an unknown model or lookahead, ``1 <= start <= max_streams`` not holding, a budget or
    ``seconds`` not > 0."""
    from oasr.bench.capacity import device_name

    spec = _check_model(model)
    lookaheads = list(spec["lookaheads"] if lookaheads is None else lookaheads)
    bad = [a for a in lookaheads if a not in spec["lookaheads"]]
    if bad or not lookaheads:
        raise ValueError(f"nemotron capacity: lookaheads {bad or lookaheads} not among {model}'s trained "
                         f"{', '.join(map(str, spec['lookaheads']))}")
    if start < 1 or max_streams < start or not latency_budget_ms > 0 or not seconds > 0 or (
            time_budget_s is not None and not time_budget_s > 0):
        raise ValueError(f"nemotron capacity: need 1 <= start <= max_streams, a budget > 0, seconds > 0 and a time "
                         f"budget > 0, got start={start}, max_streams={max_streams}, "
                         f"latency_budget_ms={latency_budget_ms}, seconds={seconds}, time_budget_s={time_budget_s}")
    t_start = time.perf_counter()
    audio = synthetic_audio()
    slots = max_streams + max_streams // 4  # a lane's next clip opens while its last chunk is in flight
    rows, setup_s = [], 0.0
    for a in lookaheads:
        if time_budget_s is not None and time.perf_counter() - t_start + setup_s > time_budget_s:
            rows.append({"section": "capacity", "case": f"lookahead {a}", "model": model, "stopped": "time budget"})
            continue
        built = time.perf_counter()
        summary = {"section": "capacity", "case": f"lookahead {a}", "model": model, "device": device_name(device),
                   "chunk_ms": None, "latency_budget_ms": latency_budget_ms, "max_streams_held": 0,
                   "gpu_busy_max": None, "stopped": None, "setup_s": None, "note": None}
        try:
            _lookahead_rows(model, a, device, slots, audio, latency_budget_ms, start, max_streams, seconds,
                            time_budget_s, t_start, progress, rows, summary)
        except (RuntimeError, MemoryError) as exc:  # e.g. out of device memory at a width: keep the rows so far
            summary["stopped"] = f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        setup_s = summary["setup_s"] if summary["setup_s"] is not None else time.perf_counter() - built
        rows.append(summary)
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return rows
