"""Bench section: shared decoder pages (copy-on-write beams, prefix caching).

Two measurements, reference against fast:

* **Beam search** at beam 4 and 8 on one utterance, over copy-on-write paged
  beams against dense beams, for two decoders: the shipped speech model's
  attention decoder on the encoder output of a shipped clip (full context; what
  a user's beams hold: ~100 cross frames, hypotheses of ~50 characters), and
  the seeded toy ``AttentionDecoder`` (hidden 32, 12 random cross frames, 16
  tokens: a step there is mostly per-call overhead, so it shows the fixed
  bookkeeping cost). Time: median ms of the whole search (paged: admission,
  the search and the rows' finish on a manager made once per row of the table,
  as an engine holds one pool; dense: the group's buffers made per search, as
  a dense group is); the four searches (each twin, each storage) are timed in
  turn within every repeat, so a change in load touches every column alike;
  ``paged_over_dense`` (on the paged rows, per twin) is the median over repeats
  of the two storages' ratio within the repeat (their searches ran back to
  back: load that drifts between repeats cancels, where a ratio of two medians
  would carry it). Memory: ``kv_bytes`` is what the beams' K/V occupy at
  the peak step: for paged beams the most pages held at once (self and cross,
  each shared page counted once) times the bytes of a page; for dense beams
  ``beam x (capacity + cross extent)`` token slots, the buffers a dense group
  holds (a dense ``select`` also allocates the next group before the old one
  goes, which this leaves out). ``same_tokens``: both storages found the same
  hypothesis in both twins; ``score_diff``: the largest |paged - dense| score.
  (The reference's is 0: it reads every beam's pages itself. The fast twin's
  paged kernel sums in another order than the dense attention, and it reads the
  cross region the beams share once, one grouped matmul for all of them: its
  scores differ by ~1e-6.)
* **Prefix hits**: ``STREAMS`` rows whose prompts share a ``SHARED``-token head
  (then ``OWN`` tokens of their own) are served one after another and retired.
  ``prefill_tokens`` counts the tokens each configuration had to compute and
  write; with prefix caching, a row computes only what ``admit_prompt`` did not
  find. Time: median ms of serving the whole workload (cache side: ``reset``,
  then per stream admit, ``admit_prompt``, ``extend``, ``retire``) on a manager
  made once per twin, as a server holds one; the K/V written are drawn before
  the timing; the twins timed alternately. Rows share within one scope (one
  utterance's hypotheses, or a decoder without cross-attention: see
  ``oasr.decoder.prefix_cache``).
"""

from __future__ import annotations

import statistics

import torch

from oasr.bench import alternating_samples, paired_ms
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.decoder.kv import PagedDecoderKV

STREAMS, SHARED, OWN, PAGE = 32, 48, 5, 16


def _search(ops, storage, decoder, enc, cfg, beam: int, max_new: int, peak: list, manager=None):
    """One beam search; ``peak[0]`` gets the K/V bytes the beams occupy at their peak (module docstring).
    Paged beams run on ``manager`` (made once for the row's searches, as an engine holds one pool; a fresh
    one if None): admitted, searched, finished."""
    if storage == "dense":
        kv = ops.DenseDecoderKV(cfg, 1, capacity=1 + max_new, cross_capacity=enc.shape[0])
        peak[0] = beam * (1 + max_new + enc.shape[0]) * (cfg.bytes_per_block // cfg.page_size)
        return decoder.beam_search(kv, enc, beam, max_new)
    manager = ops.DecoderKVCacheManager(cfg) if manager is None else manager
    step, used = manager.open_step, [0]

    def watched(rows, **kw):  # a decode group's step (PagedDecoderKV.begin_step): the pages are taken here
        handle = step(rows, **kw)
        used[0] = max(used[0], manager.pool.num_used_blocks)
        return handle

    manager.open_step = watched
    try:
        kv = PagedDecoderKV.admit(manager, [decoder.request(enc.shape[0], max_new)], ops)
        found = decoder.beam_search(kv, enc, beam, max_new)
        for r in manager.rows:
            manager.finish(r)
    finally:
        del manager.open_step  # (the class's again)
    peak[0] = used[0] * cfg.bytes_per_block
    return found


def _decoders(quick: bool, device) -> list[tuple]:
    """``(label, decoder, encoder output, max_new_tokens)``: the shipped model's decoder on a shipped clip,
    and the seeded toy decoder on random frames."""
    from oasr.asr.audio import load_audio
    from oasr.asr.checkpoint import default_model_path, load_checkpoint
    from oasr.asr.testset import load_testset
    from oasr.features.fbank import fbank
    from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig

    encoder, decoder, _, cmvn, _ = load_checkpoint(default_model_path())
    clip = load_testset(limit=1)[0]
    with torch.no_grad():
        x = cmvn.normalize(torch.from_numpy(fbank(load_audio(clip.path))))[None]
        hidden, _ = encoder.encode(x, chunk_size=x.shape[1], num_left_chunks=-1)
    toy = AttentionDecoder(DecoderConfig(seed=3)).to(device)
    noise = torch.randn(12, toy.config.encoder_dim, generator=torch.Generator().manual_seed(1)).to(device)
    return [("shipped decoder", decoder.to(device), hidden[0].to(device), 40 if quick else 80),
            ("seeded toy decoder", toy, noise, 8 if quick else 16)]


def _beam_rows(quick: bool, device) -> list[dict]:
    from oasr import fast, reference

    rows = []
    for model, decoder, enc, max_new in _decoders(quick, device):
        for beam in (4, 8):
            rows += _beam_pair(model, decoder, enc, max_new, beam, quick, device, (reference, fast))
    return rows


def _beam_pair(model, decoder, enc, max_new, beam, quick, device, twins) -> list[dict]:
    """The paged and the dense row of one decoder and beam (see the module docstring)."""
    cfg = decoder.config.cache_config(max_rows=beam, max_self_tokens=1 + max_new, max_cross_tokens=enc.shape[0],
                                      device=device)
    results, out, args = {}, {}, {}
    for storage in ("paged", "dense"):
        label = "paged (copy-on-write)" if storage == "paged" else "dense"
        out[storage] = {"section": "shared_pages", "case": f"{model}, beam={beam} {label}",
                        "cross_frames": enc.shape[0]}
    for name, ops in zip(("reference", "fast"), twins, strict=True):
        for storage in ("paged", "dense"):
            peak = [0]
            manager = ops.DecoderKVCacheManager(cfg) if storage == "paged" else None
            args[name, storage] = (ops, storage, decoder, enc, cfg, beam, max_new, peak, manager)
            results[storage, name] = _search(*args[name, storage])
            out[storage]["kv_bytes"] = peak[0]
    # the four searches timed in turn within every repeat: a change in load touches every column alike
    order = list(args)
    samples = alternating_samples([lambda a=args[key]: _search(*a) for key in order], repeats=1 if quick else 25,
                                  device=device)
    ms = dict(zip(order, samples, strict=True))
    for name in ("reference", "fast"):
        paged, dense = ms[name, "paged"], ms[name, "dense"]
        out["paged"][f"{name}_ms"], out["dense"][f"{name}_ms"] = statistics.median(paged), statistics.median(dense)
        # each repeat's two searches ran back to back: the median of their ratios (load drift cancels)
        out["paged"][f"{name}_paged_over_dense"] = statistics.median(p / d for p, d in zip(paged, dense, strict=True))
    same = all(results["paged", n][0] == results["dense", n][0] for n in ("reference", "fast"))
    diff = max(abs(results["paged", n][1] - results["dense", n][1]) for n in ("reference", "fast"))
    for row in out.values():
        row["same_tokens"] = same
        row["score_diff"] = diff
        row["tokens"] = len(results["paged", "fast"][0])
    return list(out.values())


def _serve(manager, prompts, cached: bool, kv: dict) -> int:
    """Serve ``prompts`` one after another on ``manager`` (reset first: an empty prefix index); returns the
    prefill tokens computed. ``kv``: a K/V pair per token count (made before the timing: the values do
    not matter, and drawing them is not the cache's work)."""
    manager.reset()
    computed = 0
    for prompt in prompts:
        (row,) = manager.admit([DecoderRequest(len(prompt), 0)])
        hit = manager.admit_prompt(row, prompt) if cached else 0
        manager.extend(row, *kv[len(prompt) - hit])
        computed += len(prompt) - hit
        if cached:
            manager.retire(row, prompt)
        else:
            manager.finish(row)
    return computed


def _prefix_rows(quick: bool, device) -> list[dict]:
    from oasr import fast, reference

    streams = 8 if quick else STREAMS
    head = list(range(100, 100 + SHARED))
    prompts = [head + [s] * OWN for s in range(streams)]
    cfg = DecoderCacheConfig(num_layers=2, n_kv_head=4, head_dim=64, page_size=PAGE, max_num_blocks=64, max_rows=4,
                             max_self_tokens=SHARED + OWN, kv_storage="paged", device=device)
    g = torch.Generator().manual_seed(0)
    kv = {}
    for n in range(SHARED + OWN + 1):
        k = torch.randn(cfg.num_layers, n, cfg.n_kv_head, cfg.head_dim, generator=g).to(device)
        kv[n] = (k, k)
    # the managers of a server, made once (their pools are allocated and zeroed here, not in the timing)
    managers = {ops: ops.DecoderKVCacheManager(cfg) for ops in (reference, fast)}
    rows = []
    for cached in (False, True):
        row = {"section": "shared_pages", "case": f"{streams} streams, {SHARED}-token shared prompt, "
                                                  f"prefix caching {'on' if cached else 'off'}"}
        for ops in (reference, fast):
            row["prefill_tokens"] = _serve(managers[ops], prompts, cached, kv)
        # a workload of ~10 ms: the twins timed alternately, so a change in load touches both alike
        row["reference_ms"], row["fast_ms"] = paired_ms(
            lambda on=cached: _serve(managers[reference], prompts, on, kv),
            lambda on=cached: _serve(managers[fast], prompts, on, kv), repeats=1 if quick else 9, device=device)
        rows.append(row)
    rows[1]["tokens_saved"] = rows[0]["prefill_tokens"] - rows[1]["prefill_tokens"]
    return rows


def section(quick: bool, device="cpu") -> list[dict]:
    """This section's rows (``quick``: the reduced grid) on ``device``; see the module docstring."""
    device = torch.device(device)
    return _beam_rows(quick, device) + _prefix_rows(quick, device)
