"""``python -m oasr engine-demo``: dozens of synthetic streams through the engine, checked and measured.

Streams of varied lengths (1 to 12 s of 10 ms feature frames) start at
different ticks and push their features in uneven pieces, as a client would.
One ``StreamingEngine`` serves them all on one shared pool. Afterwards a sample
of streams is rerun one at a time on the reference twin and offline; the run
prints a summary, the memory by component, the vLLM-style utilisation of the
paged pool against per-stream contiguous caches, and writes a plot of pool
occupancy and active streams over ticks.

The model is the seeded random ``StreamingConformer``: tokens mean nothing,
but every number about caches, batching and memory is real.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from oasr.cache.config import CacheConfig
from oasr.cache.memory import bytes_per_kv_block, footprint, format_bytes
from oasr.commands import CommandParser, check_at_least, check_device, check_fits, check_output_path
from oasr.ctc.config import CtcDecoderConfig
from oasr.engine import StreamingEngine, decode_utterance, memory_utilisation
from oasr.fast.kernels.registry import HEAD_DIMS as CUDA_HEAD_DIMS  # what the CUDA kernels tile
from oasr.kv_formats import FORMAT_NAMES as KV_FORMAT_NAMES
from oasr.kv_formats import get_format
from oasr.models import ConformerConfig, StreamingConformer, twin_ready
from oasr.reference.fp8 import dequantize, quantize

FRAME_SECONDS = 0.01  # one feature frame
CHECK_ATOL = 1e-5
CHECK_ATOL_FP8 = 5e-2  # a few e4m3 steps; see check_sample (the bound for every quantized format)
DEFAULT_BEAM = 4


@dataclass
class DemoStream:
    stream_id: str
    start_tick: int
    features: torch.Tensor


def make_workload(num_streams: int, input_dim: int, seed: int, min_seconds=1.0, max_seconds=12.0,
                  spread_ticks: int = 24) -> list[DemoStream]:
    """Streams with log-uniform lengths and uniform start ticks (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    streams = []
    for i in range(num_streams):
        u = torch.rand((), generator=g).item()
        seconds = min_seconds * (max_seconds / min_seconds) ** u
        frames = int(seconds / FRAME_SECONDS)
        start = int(torch.randint(0, spread_ticks + 1, (), generator=g))
        streams.append(DemoStream(f"s{i:03d}", start, torch.randn(frames, input_dim, generator=g)))
    return streams


def drive(engine: StreamingEngine, workload: list[DemoStream], seed: int, chunk_frames: int, progress=None,
          suspend_every: int = 0) -> list[int]:
    """Push every stream in pieces of 0.5 to 1.5 chunks per tick from its start tick; tick until all finish.

    With ``suspend_every=N`` every N ticks one active stream (round robin) is also suspended
    and resumed at once (``suspend_session``; deferred while a stream waits for admission);
    returns the session sizes in bytes.
    """
    g = torch.Generator().manual_seed(seed + 1)
    sessions: list[int] = []
    since_suspend = 0
    pos = {s.stream_id: 0 for s in workload}
    ended = set()
    tick = 0
    while True:
        for s in workload:
            sid = s.stream_id
            if tick == s.start_tick:
                engine.add_stream(sid)
            if tick < s.start_tick or sid in ended:
                continue
            n = int(torch.randint(chunk_frames // 2, chunk_frames * 3 // 2 + 1, (), generator=g))
            engine.push(sid, s.features[pos[sid] : pos[sid] + n])
            pos[sid] += n
            if pos[sid] >= s.features.shape[0]:
                engine.end_stream(sid)
                ended.add(sid)
        engine.step()
        if progress is not None:
            progress.update(engine.stats[-1].input_frames)
        tick += 1
        if len(ended) == len(workload) and all(engine.status(s.stream_id) == "finished" for s in workload):
            return sessions
        since_suspend += 1
        if suspend_every and since_suspend >= suspend_every and suspend_session(engine, len(sessions), sessions):
            since_suspend = 0


def suspend_session(engine: StreamingEngine, turn: int, sizes: list) -> bool:
    """Suspend the ``turn``-th active stream (round robin) to session bytes and resume it from them.

    Only between ticks with nobody waiting for admission: then the resumed stream is readmitted
    at the next tick in the cohort it left, and the run's output stays exactly that of a run
    without suspension (the demo's test checks it). Otherwise a newcomer could take its slot,
    which changes cohorts, and with them the floating-point rounding of a batched forward.
    """
    active = engine.active_ids
    if not active or engine.num_waiting:
        return False
    sid = active[turn % len(active)]
    data = engine.suspend(sid)
    sizes.append(len(data))
    engine.resume(data)
    return True




def demo_head_dim(args) -> int:
    """``--head-dim``, else 16 on the CPU (a small, quick model) and 64 on CUDA (the kernels tile 64 or 128)."""
    head_dim = getattr(args, "head_dim", None)  # callers that build their own Namespace may leave it out
    if head_dim is not None:
        return head_dim
    return 64 if torch.device(args.device).type == "cuda" else 16


def configs(args) -> tuple[ConformerConfig, CacheConfig]:
    """The model's and the caches' configs for the options (cheap: builds no model; raises ``ValueError``)."""
    num_left_chunks = args.num_left_chunks
    if num_left_chunks is None:
        num_left_chunks = 4 if args.eviction or args.prefill else -1
    mcfg = ConformerConfig(input_dim=40, hidden_dim=64, num_layers=args.layers, n_head=4, n_kv_head=2,
                           head_dim=demo_head_dim(args),
                           ffn_dim=128, kernel_size=15, vocab_size=64, chunk_size=16,
                           num_left_chunks=num_left_chunks, subsample_channels=64, seed=args.seed)
    max_frames = int(12.0 / FRAME_SECONDS) // mcfg.subsampling_rate
    cache = mcfg.cache_config(
        block_size_frames=16, max_batch_size=args.max_batch_size, max_blocks_per_seq=-(-max_frames // 16) + 1,
        prefill_kv_window=args.prefill, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
    )
    return mcfg, cache


def decoder_config(args) -> CtcDecoderConfig | None:
    """The CTC prefix beam search's config, or None for greedy decoding (raises ``ValueError``)."""
    if args.decoder != "beam":
        return None
    # --rescore: the second pass rescores the beam's n-best, so keep all of it
    return CtcDecoderConfig(beam_size=args.beam, token_topk=args.beam, nbest=args.beam if args.rescore else 1)


def build(args) -> tuple[StreamingConformer, CacheConfig]:
    """The seeded model (on ``args.device``) and the cache config for the options."""
    mcfg, cache = configs(args)
    return StreamingConformer(mcfg).to(args.device), cache


def fp8_round_trip(t: torch.Tensor) -> torch.Tensor:
    """``t`` quantized to e4m3 pages and back: what fp8 K/V storage does to it."""
    return dequantize(*quantize(t), t.dtype)


def format_round_trip(name: str):
    """What pages of format ``name`` store, as a function of K/V (``oasr.kv_formats``' reference rule)."""
    if name == "fp8_e4m3":
        return fp8_round_trip
    fmt = get_format(name)
    return lambda t: fmt.dequantize(*fmt.quantize(t, t.dtype), t.dtype)


def check_sample(model, cache_config, engine, workload, count: int) -> tuple[bool, str]:
    """Rerun ``count`` streams one at a time on the reference twin, and offline; compare with the engine.

    In the model dtype the three agree to float rounding (bound ``CHECK_ATOL``) and the tokens are equal.
    With fp8 pages the offline oracle stores its K/V the same way, but a key computed in a cohort of
    a different size differs from the lone run's by float rounding, and a value that close to an e4m3
    rounding midpoint lands on the neighbouring fp8 value: agreement is then to within a few fp8
    steps (``CHECK_ATOL_FP8``), and near-tied tokens may differ, which is reported, not failed.
    """
    fp8 = cache_config.kv_quantized  # any quantized format (fp8's reasoning holds for each: see above)
    bound = CHECK_ATOL_FP8 if fp8 else CHECK_ATOL
    sample = workload[:: max(1, len(workload) // max(count, 1))][:count]
    worst_ref, worst_off, same_tokens = 0.0, 0.0, 0
    for s in sample:
        got = engine.result(s.stream_id)
        alone = StreamingEngine(model, cache_config, twin="reference", decoder=engine.decoder,
                                ctc_config=engine.ctc_config, keep_log_probs=True)
        alone.add_stream(s.stream_id)
        alone.push(s.stream_id, s.features)
        alone.end_stream(s.stream_id)
        ref = alone.run()[s.stream_id]
        feats = s.features[None].to(cache_config.device)
        off = model.forward_offline(feats, prefill_window=cache_config.prefill_kv_window,
                                    kv_transform=format_round_trip(cache_config.kv_cache_dtype) if fp8 else None,
                                    )[0][0].float().cpu()
        worst_ref = max(worst_ref, (got.log_probs - ref.log_probs).abs().max().item())
        worst_off = max(worst_off, (got.log_probs - off).abs().max().item())
        first = got.tokens if got.first_pass is None else got.first_pass  # --rescore: check the CTC pass
        same_tokens += first == ref.tokens == decode_utterance(off, engine.decoder, engine.ctc_config)
    ok = worst_ref <= bound and worst_off <= bound and (fp8 or same_tokens == len(sample))
    verdict = "OK" if ok else "MISMATCH"
    both = f" ({cache_config.kv_cache_dtype} K/V on both)" if fp8 else ""
    return ok, (f"sample check: {len(sample)} streams rerun alone on the reference twin and offline"
                f"{both}: tokens equal for {same_tokens}/{len(sample)}, "
                f"max |d log-prob| {worst_ref:.1e} (reference), {worst_off:.1e} (offline), "
                f"bound {bound:.0e} -> {verdict}")


def plot(engine, path: str, title: str) -> None:
    """Write the pool-occupancy and streams-per-tick figure of ``engine``'s run to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks = [s.tick for s in engine.stats]
    pool = engine.config.max_num_blocks
    bs = engine.config.block_size_frames
    longest = engine.longest_extent
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    top.plot(ticks, [100 * s.used_blocks / pool for s in engine.stats], label="paged: blocks in use")
    top.plot(ticks, [100 * s.live_frames / (pool * bs) for s in engine.stats], label="live K/V frames", ls="--")
    top.plot(ticks, [100 * s.active * longest / (pool * bs) for s in engine.stats],
             label=f"contiguous: active x longest stream ({longest} frames)", ls=":")
    top.set_ylabel(f"% of pool ({pool} blocks)")
    top.set_ylim(0, None)
    top.legend(loc="upper left", fontsize=8)
    top.set_title(title)
    bottom.plot(ticks, [s.active for s in engine.stats], label="active streams")
    bottom.plot(ticks, [s.waiting for s in engine.stats], label="ready, waiting for admission")
    bottom.step(ticks, [s.width for s in engine.stats], label="cohort width (padded)", where="mid", alpha=0.6)
    bottom.axhline(engine.config.max_batch_size, color="grey", lw=0.8, ls=":", label="max_batch_size")
    bottom.set_xlabel("tick")
    bottom.set_ylabel("streams")
    bottom.set_ylim(0, engine.config.max_batch_size * 1.6)
    bottom.legend(loc="upper left", fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def kv_storage_lines(cfg) -> list[str]:
    """What the K/V storage format costs per block, and what it saves against the model dtype."""
    per_block = bytes_per_kv_block(cfg)
    if not cfg.kv_quantized:
        return [f"  K/V storage   {cfg.dtype} pages: {format_bytes(per_block)} per block"]
    plain = bytes_per_kv_block(dataclasses.replace(cfg, kv_cache_dtype=None))
    name = "fp8" if cfg.kv_cache_dtype == "fp8_e4m3" else cfg.kv_cache_dtype
    rule = cfg.kv_format.summary if name != "fp8" else "fp8 e4m3 pages + one fp32 scale per vector"
    return [
        f"  K/V storage   {rule}: {format_bytes(per_block)} per block, "
        f"against {format_bytes(plain)} in {cfg.dtype}",
        f"  {name} saves {format_bytes((plain - per_block) * cfg.max_num_blocks)} of K/V pool "
        f"({100 * (1 - per_block / plain):.1f}%); the same bytes hold {plain / per_block:.2f}x the blocks",
    ]


def summary(engine, workload, wall: float, args) -> list[str]:
    """The run's summary lines: geometry, throughput, peak pool, memory by component and utilisation."""
    cfg, mcfg = engine.config, engine.model.config
    results = [engine.result(s.stream_id) for s in workload]
    reasons = {r: sum(1 for x in results if x.finish_reason == r) for r in ("eos", "length")}
    input_frames = sum(s.features.shape[0] for s in workload)
    encoder_frames = sum(r.num_frames for r in results)
    audio = input_frames * FRAME_SECONDS
    peak = max(engine.stats, key=lambda s: s.used_blocks)
    window = "unlimited history" if not cfg.eviction else f"window {cfg.history_frames} frames (eviction on)"
    widths = sorted({s.width for s in engine.stats if s.width})
    fp = footprint(cfg, scratch_blocks=1, pad_lanes=1)
    slot_bytes = sum(buf.numel() * buf.element_size() for buf in engine.states.buffers.values())
    util = memory_utilisation(engine)
    chunk_s = mcfg.chunk_input_frames * FRAME_SECONDS
    lines = [
        f"oasr engine-demo: {len(workload)} streams through StreamingEngine (twin={engine.twin}, device={cfg.device}, "
        f"{mcfg.num_layers} layers, hidden {mcfg.hidden_dim}, {mcfg.n_head} query / {mcfg.n_kv_head} KV heads)",
        f"  cache       chunk {cfg.chunk_size} frames ({chunk_s:.2f} s), {window}, block {cfg.block_size_frames} "
        f"frames, pool {cfg.max_num_blocks} blocks, max_batch_size {cfg.max_batch_size}, "
        f"prefill {'on' if cfg.prefill_kv_window else 'off'}",
        f"  streams     {len(results)} finished: {reasons['eos']} eos, {reasons['length']} length",
        f"  frames      {input_frames} feature frames ({audio:.1f} s of audio) -> {encoder_frames} encoder frames",
        f"  wall        {wall:.2f} s: {input_frames / wall:.0f} feature frames/s, {audio / wall:.1f}x real time",
        f"  ticks       {engine.tick}, cohort widths used {widths}",
        f"  model step  {engine.execution_note}",
        f"  peak pool   {peak.used_blocks}/{cfg.max_num_blocks} blocks "
        f"({100 * peak.used_blocks / cfg.max_num_blocks:.1f}%) at tick {peak.tick}; "
        f"peak active {max(s.active for s in engine.stats)}, "
        f"peak waiting {max(s.waiting for s in engine.stats)}",
        "memory by component (allocated up front):",
        fp.format(),
        *kv_storage_lines(cfg),
        f"  {'slot_states':13s} {format_bytes(slot_bytes):>12s}   (declared subsampling tails)",
        f"memory utilisation at peak pool occupancy (tick {util['tick']}, {util['active_streams']} active streams), "
        "vLLM-style:",
        f"  live K/V      {util['live_frames']} frames ({format_bytes(util['live_bytes'])})",
        f"  paged         {util['paged_blocks']} blocks x {cfg.block_size_frames} = {util['paged_frames']} frames "
        f"({format_bytes(util['paged_bytes'])}): {100 * util['paged_utilisation']:.1f}% live",
        f"  contiguous    {util['active_streams']} streams x {util['longest_stream_frames']} frames (longest "
        f"stream) = {util['contiguous_frames']} frames ({format_bytes(util['contiguous_bytes'])}): "
        f"{100 * util['contiguous_utilisation']:.1f}% live",
    ]
    return lines


def transcripts(engine, workload, limit: int = 12) -> list[str]:
    """Each stream's best token sequence (the model is random: the ids mean nothing, the decoding is real).

    Beside it, ``CTC log p``: the CTC prefix beam search's score of the sequence shown. With attention
    rescoring the shown sequence is the second pass's choice among the n-best, so its score is looked up
    in the n-best (it need not be the best first-pass score).
    """
    if engine.ctc is None:
        how = "greedy CTC"
    else:
        how = f"CTC prefix beam search, beam {engine.ctc_config.beam_size}, pooled states"
        if getattr(engine, "rescore", False):
            how = f"attention-rescored n-best of the {how}"
    lines = [f"best token sequences ({how}; first {limit} tokens):"]
    for s in workload:
        r = engine.result(s.stream_id)
        shown = " ".join(map(str, r.tokens[:limit])) + (" ..." if len(r.tokens) > limit else "")
        ctc = next((h.log_score for h in r.nbest if list(h.tokens) == list(r.tokens)), None)
        score = f"  CTC log p {ctc:9.2f}" if ctc is not None else ""
        lines.append(f"  {s.stream_id}  {len(r.tokens):3d} tokens{score}  [{shown}]")
    if engine.ctc is not None:
        lines.append(f"  decoder states created: {engine.ctc.num_created} for {len(workload)} streams (pooled, reused)")
    return lines


PLOT_SUFFIXES = (".png", ".pdf", ".svg")  # what plot() writes (matplotlib's Agg, PDF and SVG backends)


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option, before any work: a bad one is a usage error (one line on stderr, exit status 2)."""
    if args.beam is not None and args.decoder != "beam":
        parser.error(f"--beam {args.beam} sizes the CTC prefix beam search; --decoder {args.decoder} has no beam "
                     "(drop --beam or use --decoder beam)")
    if args.beam is None:
        args.beam = DEFAULT_BEAM
    check_at_least(parser, args, {"streams": 1, "layers": 1, "max_batch_size": 1, "beam": 1, "check_sample": 0,
                                  "suspend_every": 0, "threads": 1})
    if args.num_left_chunks is not None and args.num_left_chunks < -1:
        parser.error(f"--num-left-chunks must be -1 (unlimited history) or >= 0, got {args.num_left_chunks}")
    if args.num_left_chunks == -1 and (args.eviction or args.prefill):
        flag = "--prefill" if args.prefill else "--eviction"
        parser.error(f"{flag} needs a bounded window, but --num-left-chunks -1 asks for unlimited history; "
                     f"give --num-left-chunks >= 1 or leave it out (4)")
    check_device(parser, args.device)
    if args.head_dim is not None and args.head_dim < 1:
        parser.error(f"--head-dim must be >= 1, got {args.head_dim}")
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda and args.twin == "fast" and demo_head_dim(args) not in CUDA_HEAD_DIMS:
        parser.error(f"--head-dim {args.head_dim} on CUDA: the fast twin's kernels tile head_dim {CUDA_HEAD_DIMS}")
    if args.cuda_graphs and (torch.device(args.device).type != "cuda" or args.twin != "fast"):
        parser.error(f"--cuda-graphs needs --device cuda and --twin fast (got --device {args.device}, --twin "
                     f"{args.twin}): graphs capture the fast twin's model step on a GPU; the CPU runs eager")
    if args.rescore and args.decoder != "beam":
        parser.error("--rescore rescores the CTC beam search's n-best; it needs --decoder beam")
    if args.plot:
        check_output_path(parser, args.plot, "--plot")
        if not args.plot.lower().endswith(PLOT_SUFFIXES):
            parser.error(f"--plot {args.plot}: the plot is written as {', '.join(PLOT_SUFFIXES)}, by the path's "
                         "suffix; give a path ending in one of them ('' for no plot)")
    try:
        _, cache_config = configs(args)  # every rule the configs enforce, without building the model
        decoder_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    copies = 2 if args.check_sample else 1  # the sample check builds a second engine of the same size
    check_fits(parser, copies * footprint(cache_config, scratch_blocks=1, pad_lanes=1).total, args.device,
               f"--max-batch-size {args.max_batch_size}: the caches" + (" (twice, with --check-sample)" * (copies > 1)))


def rescoring_lines(engine, workload, sample: int = 4, limit: int = 12) -> list[str]:
    """First-pass (CTC) and rescored (decoder log-likelihood + ctc_weight * CTC score) tokens for a sample."""
    changed = sum(engine.result(s.stream_id).tokens != engine.result(s.stream_id).first_pass for s in workload)
    lines = [f"attention rescoring (seeded {engine.rescorer.config.num_layers}-layer attention decoder, "
             f"ctc_weight {engine.ctc_weight}, n-best {engine.ctc_config.nbest}): the second pass changed "
             f"{changed} of {len(workload)} streams"]

    def shown(tokens):
        return " ".join(map(str, tokens[:limit])) + (" ..." if len(tokens) > limit else "")

    for s in workload[:sample]:
        r = engine.result(s.stream_id)
        lines.append(f"  {s.stream_id}  first pass [{shown(r.first_pass)}]")
        lines.append(f"  {' ' * len(s.stream_id)}  rescored   [{shown(r.tokens)}]")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m oasr engine-demo`` with ``argv`` (default: the process's arguments); returns the exit status."""
    parser = CommandParser(prog="python -m oasr engine-demo", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    parser.add_argument("--streams", type=int, default=48, help="number of synthetic streams")
    parser.add_argument("--layers", type=int, default=2, help="Conformer blocks")
    parser.add_argument("--twin", choices=("fast", "reference"), default="fast", help="engine twin")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--num-left-chunks", type=int, default=None,
                        help="attention window in chunks, >= 0; -1 = unlimited history "
                             "(default: -1, or 4 with --eviction or --prefill)")
    parser.add_argument("--eviction", action="store_true",
                        help="bounded window with eviction (num_left_chunks 4 unless given)")
    parser.add_argument("--prefill", action="store_true",
                        help="prefill a zeroed K/V window (implies --eviction; needs num_left_chunks >= 1)")
    parser.add_argument("--kv-cache-dtype", choices=("model", "auto", *KV_FORMAT_NAMES[1:]), default=None,
                        help="K/V page format (oasr.kv_formats; python -m oasr formats shows their bytes and "
                             "what serves them): fp8_e4m3 / int8 with one fp32 scale per vector, q8_0 and "
                             "affine4 need head_dim a multiple of 32 (default: model dtype)")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="attention head size (default: 16 on the CPU; 64 on CUDA, whose kernels tile 64 or 128)")
    parser.add_argument("--max-batch-size", type=int, default=16, help="concurrent streams")
    parser.add_argument("--decoder", choices=("beam", "greedy"), default="beam",
                        help="CTC prefix beam search with pooled states, or greedy")
    parser.add_argument("--beam", type=int, default=None,
                        help=f"beam size, with --decoder beam only (default: {DEFAULT_BEAM})")
    parser.add_argument("--check-sample", type=int, default=4, help="streams rerun on the reference twin (0: none)")
    parser.add_argument("--plot", default="oasr_demo.png",
                        help="plot of pool occupancy and streams over ticks, .png, .pdf or .svg ('': no plot)")
    parser.add_argument("--suspend-every", type=int, default=0, metavar="N",
                        help="every N ticks suspend one active stream to session bytes and resume it (default 0: off)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="replay one CUDA graph per cohort width for the model step (default: on for the fast "
                             "twin on CUDA; the CPU always runs eager)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the model's weights")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: the demo's small ops run fastest on one; more threads only "
                             "contend on a loaded machine)")
    parser.add_argument("--rescore", action="store_true",
                        help="attention rescoring of each stream's CTC n-best when it ends (U2/WeNet two-pass)")
    args = parser.parse_args(argv)
    _check_args(parser, args)

    if not twin_ready(args.twin):
        print(f"demo: oasr.{args.twin} does not provide the cache managers yet; run with --twin reference",
              file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(f"demo: {args.threads} torch thread(s) (--threads)")
    model, cache_config = build(args)
    workload = make_workload(args.streams, model.config.input_dim, args.seed)
    ctc_config = decoder_config(args)
    engine = StreamingEngine(model, cache_config, twin=args.twin, decoder=args.decoder, ctc_config=ctc_config,
                             keep_log_probs=args.check_sample > 0, rescore=args.rescore,
                             cuda_graphs=args.cuda_graphs)
    total = sum(s.features.shape[0] for s in workload)
    progress = tqdm(total=total, unit="frame", unit_scale=True, desc="demo", disable=args.quiet, file=sys.stderr)
    start = time.perf_counter()
    sessions = drive(engine, workload, args.seed, model.config.chunk_input_frames, progress, args.suspend_every)
    wall = time.perf_counter() - start
    progress.close()

    for line in summary(engine, workload, wall, args) + transcripts(engine, workload):
        print(line)
    if args.suspend_every:
        mean = sum(sessions) / len(sessions) if sessions else 0
        print(f"sessions: {len(sessions)} suspensions and resumes (every {args.suspend_every} ticks, deferred while a "
              f"stream waited for admission), {format_bytes(mean)} per session on average")
    if args.rescore:
        for line in rescoring_lines(engine, workload):
            print(line)
    ok = True
    if args.check_sample > 0:
        ok, line = check_sample(model, cache_config, engine, workload, args.check_sample)
        print(line)
    if args.plot:
        plot(engine, args.plot, f"{len(workload)} streams, twin={engine.twin}, "
                                f"num_left_chunks={cache_config.num_left_chunks}")
        print(f"plot: {args.plot}")
    return 0 if ok else 1
