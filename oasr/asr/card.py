"""The model card shipped beside the weights: what the model is, how it was made, how well it hears."""

from __future__ import annotations

from pathlib import Path


def model_card(spec, info: dict, results: dict) -> str:
    """Markdown for ``MODEL_CARD.md``. ``results``: name -> an ``oasr eval`` result dict."""
    enc, dec = spec.encoder, spec.decoder
    share = info.get("serving_share")
    share = "?" if share is None else f"{100 * share:.0f}%"
    lines = [
        "# oasr streaming Conformer (synthesized English)",
        "",
        "A small CTC/attention model trained by `python -m oasr train` on two CPU cores. It exists so the caches",
        "in this library serve a model that hears: WER is measured against every cache choice.",
        "",
        "## Model",
        f"- encoder: the project's `StreamingConformer`, {enc['num_layers']} layers, width {enc['hidden_dim']}, "
        f"{enc['n_head']} query / {enc['n_kv_head']} K/V heads of {enc['head_dim']}, conv kernel {enc['kernel_size']}, "
        f"causal 4x subsampling (40 ms frames); CTC head over characters",
        f"- decoder: `AttentionDecoder`, {dec['num_layers']} layers, width {dec['hidden_dim']}, rescoring the CTC "
        f"n-best with weight {spec.ctc_weight} on the CTC score",
        f"- parameters: {info.get('parameters', '?')}",
        f"- input: 80-dim Kaldi fbank (kaldi-native-fbank, 16 kHz), global CMVN; output: `{spec.alphabet}`",
        f"- serving defaults: chunk {enc['chunk_size']} frames ({enc['chunk_size'] * 40} ms), left context "
        f"{enc['num_left_chunks']} chunks; trained with dynamic chunks ({share} of the "
        "batches at the serving chunk and left context; of the rest half full context, half a chunk of 1-25 "
        "frames with 1-8 or unlimited left chunks), so other chunk sizes and windows work with the same weights",
        "",
        "## Data",
        "- sentences from a template generator over a closed vocabulary of about 320 words (numbers, clock times,",
        "  dates, home-assistant commands, weather, short descriptions); about 1 in 16 sentences is held out of",
        "  training by a stable hash and only those make the test set",
        "- speech: espeak-ng, 7 English accents x 20 voice variants for the first 24,000 training utterances;",
        "  12,000 more (`--extra-voice-shards 6`) by those and 18 further variants, mostly female and high-pitched",
        "  (added to the recipe after an earlier model scored worst, 31% WER, on the held-out high-pitched test",
        "  voice); 5 other variants only in the test set (never trained on, that voice included); speaking rate",
        "  125-205 wpm, pitch 25-75, speed perturbation 0.9/1.0/1.1, gain -20..-1 dBFS peak,",
        "  white or brown noise at 5-40 dB SNR on 80% of utterances, SpecAugment while training",
        f"- training utterances: {info.get('utterances', '?')}",
        "",
        "## Training",
        f"- {info.get('steps', '?')} AdamW steps ({info.get('schedule', 'warmup 400 steps, then cosine decay')}), "
        "loss 0.3 CTC + 0.7 label-smoothed attention cross-entropy; the shipped weights are the EMA",
        f"- time on this machine (two CPU cores): synthesis {info.get('synth_seconds', '?')} s, training "
        f"{info.get('train_seconds', '?')} s ({info.get('threads', '?')} torch threads)",
        "",
        "## Accuracy on the shipped held-out test set",
        "",
        "| configuration | WER % | CER % |",
        "|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {100 * r['wer']:.2f} | {100 * r['cer']:.2f} |")
    lines += ["", "Measured with `python -m oasr eval` (CTC prefix beam search, beam 8). It is synthetic speech:",
              "expect nothing of it on real recordings.", ""]
    return "\n".join(lines)


def write_model_card(path, spec, info: dict, results: dict) -> Path:
    """Write ``model_card(spec, info, results)`` to ``path`` as Markdown; returns the path."""
    path = Path(path)
    path.write_text(model_card(spec, info, results))
    return path
