"""Bench section: every K/V page format side by side (bytes, error, attention time; WER when a model is given).

Per format of ``oasr.kv_formats``, at the bench geometry (12 layers, 4 KV heads, head_dim 64, blocks
of 16 frames, a model served in fp16):

    bytes_per_frame   K and V of one frame over every layer and KV head: 2 * 12 * 4 * bytes_per_vector
    blocks_per_GiB    whole blocks of 16 frames (every layer) in one GiB
    max_err, rms_err  quantize -> dequantize (the reference rule) of random K/V, N(0, 1) in fp16, against
                      the fp16 values themselves; ``error_rows(kv)`` gives the same columns for real K/V
    reference_ms,     one attention tick (append + attention over the 12 layers, as the attention
    fast_ms           section) with the pages in that format; on the CPU in the bench dtype (fp32)
    time_vs_model     fast_ms / the model-dtype row's fast_ms: what the format costs (or saves) in time
    wer               None here: the word error rate needs a trained model and its test set. Pass
                      ``wer_rows(evaluate)`` a function ``evaluate(kv_cache_dtype) -> WER (percent)``
                      that runs the engine on the shipped test set with that CacheConfig(kv_cache_dtype=...);
                      it adds the WER per format and the difference to the model dtype.

No format is called free of accuracy cost here: ``wer_rows`` marks a format ``within_0.5`` only when its
measured WER is within 0.5 points of the model dtype's on the same set.
"""

from __future__ import annotations

import torch

from oasr.bench import paired_ms
from oasr.bench.attention import BLOCK, CHUNK, HEAD_DIM, LAYERS, N_KV, _cohort, _tick
from oasr.kv_formats import FORMATS, get_format

SERVED_DTYPE = torch.float16
NOTES = ("bytes and errors at an fp16 model; times on the CPU with fp32 queries (the torch path: it "
         "dequantizes what it gathers, so quantized pages cost time there); wer: the shipped model streaming the "
         "shipped held-out set (24 clips with --quick) with its K/V pages in that format, wer_delta in points "
         "against the model dtype; the last rows: errors on the trained model's own K/V")


def bytes_per_frame(fmt: str, dtype: torch.dtype = SERVED_DTYPE) -> int:
    """Bytes of K and V of one frame over every layer and KV head at the bench geometry, in format ``fmt``."""
    return 2 * LAYERS * N_KV * get_format(fmt).bytes_per_vector(HEAD_DIM, dtype)


def blocks_per_gib(fmt: str, dtype: torch.dtype = SERVED_DTYPE) -> int:
    """Whole blocks of ``BLOCK`` frames (every layer) in format ``fmt`` that fit in one GiB."""
    return (1 << 30) // (bytes_per_frame(fmt, dtype) * BLOCK)


def quantization_error(fmt: str, kv: torch.Tensor) -> tuple[float, float]:
    """(max, RMS) of |dequantize(quantize(kv)) - kv| with the reference rule, ``kv`` (..., head_dim) in its
    model dtype (the error against the model dtype's own values)."""
    f = get_format(fmt)
    data, scale = f.quantize(kv, kv.dtype)
    err = (f.dequantize(data, scale, torch.float32) - kv.float()).abs()
    return float(err.max()), float(err.pow(2).mean().sqrt())


def error_rows(kv: torch.Tensor, label: str = "real K/V") -> list[dict]:
    """The error columns for K/V the caller captured (e.g. a trained model's), one row per format."""
    rows = []
    for name in FORMATS:
        m, r = quantization_error(name, kv)
        rows.append({"section": "kv_formats", "case": f"{name} {label}", "max_err": m, "rms_err": r})
    return rows


def _as_format(caches, fmt: str, dtype: torch.dtype):
    """The cohort's views over pages of ``fmt``: every pool vector quantized by the reference rule."""
    from dataclasses import replace

    if fmt == "model":
        return caches
    f = get_format(fmt)
    out = []
    for c in caches:
        k, ks = f.quantize(c.k_cache, dtype)
        v, vs = f.quantize(c.v_cache, dtype)
        out.append(replace(c, k_cache=k, v_cache=v, k_scale=ks, v_scale=vs, kv_format=fmt))
    return out


def section(quick: bool, device="cpu") -> list[dict]:
    """This section's rows (``quick``: a smaller cohort and set) on ``device``; see the module docstring."""
    from oasr import fast, reference

    device = torch.device(device)
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    streams, history = (8, 256) if quick else (32, 1024)
    caches, q, k = _cohort(streams, history, device, dtype)
    sample = torch.randn(4096, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(SERVED_DTYPE)
    rows, model_ms = [], None
    for name in FORMATS:
        views = _as_format(caches, name, dtype)
        row = {"section": "kv_formats", "case": f"{name} streams={streams} history={history} block={BLOCK}"}
        row["bytes_per_frame"] = bytes_per_frame(name)
        row["blocks_per_GiB"] = blocks_per_gib(name)
        row["max_err"], row["rms_err"] = quantization_error(name, sample)
        args = (views, q, k)
        row["reference_ms"], row["fast_ms"] = paired_ms(
            lambda a=args: _tick(reference, *a), lambda a=args: _tick(fast, *a), repeats=2 if quick else 3,
            device=device,
        )
        model_ms = model_ms or row["fast_ms"]
        row["time_vs_model"] = row["fast_ms"] / model_ms
        rows.append(row)
    wers = {r["case"].split(" wer")[0]: r for r in wer_rows(lambda kv: shipped_model_wer(kv, device, quick))}
    for row in rows:
        w = wers[row["case"].split()[0]]
        row["wer"], row["wer_delta"], row["within_0.5"] = w["wer"], w["wer_delta"], w["within_0.5"]
    return rows + error_rows(trained_model_kv(quick).to(SERVED_DTYPE), "trained model's K/V")


def shipped_model_wer(kv_cache_dtype, device="cpu", quick: bool = False) -> float:
    """WER in percent of the shipped model on the shipped held-out set (the first 24 clips when ``quick``),
    streaming at its default chunk and window, with K/V pages in ``kv_cache_dtype`` (None: the model dtype)."""
    from oasr.asr.metrics import error_rates
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    clips = load_testset(limit=24 if quick else None)
    rec = Recognizer(device=str(device), kv_cache_dtype=kv_cache_dtype)
    texts = [t.text for t in rec.transcribe([c.path for c in clips])]
    return 100 * error_rates([c.text for c in clips], texts)["wer"]


def trained_model_kv(quick: bool = False) -> torch.Tensor:
    """Every layer's keys and values of the shipped model over a few shipped clips, ``(N, head_dim)`` vectors."""
    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset
    from oasr.features.fbank import fbank

    rec = Recognizer(max_streams=1)
    captured = []

    def keep(x):
        captured.append(x.detach().reshape(-1, x.shape[-1]).clone())
        return x

    for clip in load_testset(limit=2 if quick else 8):
        x = rec.cmvn.normalize(fbank(load_audio(clip.path)))[None]
        with torch.no_grad():
            rec.encoder.encode(x, kv_transform=keep)
    return torch.cat(captured)


def wer_rows(evaluate, formats=None) -> list[dict]:
    """The WER column: ``evaluate(kv_cache_dtype)`` -> WER in percent on the shipped test set (the same set,
    decoder and model for every format). Returns one row per format with ``wer``, ``wer_delta`` (points
    against the model dtype) and ``within_0.5`` (the only grounds on which a format may be called free of
    accuracy cost)."""
    names = list(formats or FORMATS)
    if "model" not in names:
        names.insert(0, "model")
    wers = {name: float(evaluate(None if name == "model" else name)) for name in names}
    base = wers["model"]
    return [{"section": "kv_formats", "case": f"{name} wer", "wer": w, "wer_delta": w - base,
             "within_0.5": abs(w - base) <= 0.5} for name, w in wers.items()]


CHUNK_FRAMES = CHUNK  # re-exported for notebooks: the tick writes CHUNK frames per stream
