"""Capacity: how many live streams one recognizer holds at real time within a latency budget.

``capacity(device, ...)`` plays the shipped clips as N live streams at real time
(``oasr.asr.live_source.play_lanes``: the audio clock runs in its own process), for N = ``start``,
2 ``start``, ... until the p99 chunk latency passes ``latency_budget_ms`` or the recognizer falls
behind real time (the last transcript comes later than one chunk plus the budget after the last
audio), or N reaches ``max_streams``. The answer is the largest N that held.

Each N is one row: chunk latency percentiles (from the moment the clock process sent a chunk's
last sample to the tick that delivered its partial result), whether it held, the WER of its
transcripts, and per stage the host microseconds per stream-chunk (``oasr.engine.stage_clock``:
ingest, front end, model step, decode, bookkeeping, delivery, and the harness's own feeding loop)
and on CUDA the device microseconds per stream-chunk of the model step and the decode (CUDA
events around each; the decode's includes the gaps while the host launches its ops) and ``gpu_busy``,
their sum over the run's wall time (how close the GPU is to busy). The process's
CPU time per stream-chunk (``cpu_us``) and the streams one core could feed at that cost
(``cpu_bound_streams``, chunk seconds over it) do not count waits for a core, so on a machine
shared with other jobs they say what the latency columns cannot. A last row
names the device and the largest N. One recognizer (shipped model, fast twin, CUDA graphs where
available) serves every N, warmed up first.

``python -m oasr bench --sections capacity [--latency-budget-ms B]``; ``--quick`` (CI): fewer and
shorter runs. ``--capacity-model nemotron-0.6b`` (or ``nemotron-tiny``): a Nemotron streaming transducer with
random weights instead, rows per lookahead (``oasr.bench.capacity_nemotron``).
"""

from __future__ import annotations

import platform
import time

import numpy as np
import torch

from oasr.engine.stage_clock import STAGES

NOTES = ("latency: ms from the clock process sending a chunk's last sample to its partial result (real time); "
         "*_us: host microseconds per stream-chunk by stage; dev_*_us: CUDA event time per stream-chunk; "
         "gpu_busy: model + decode event time over the run's wall time; "
         "held: p99 within the budget and the last transcript within a chunk plus the budget of the last audio; "
         "cpu_us: process CPU time per stream-chunk; cpu_bound_streams: streams one core feeds at that cost; "
         "Nemotron rows (--capacity-model): random weights, so wer is n/a, and ingest_us includes the log-mel")
PIECE = 640  # samples per message (40 ms), as a live client sends them


def device_name(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model and the torch threads."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__})"
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} torch thread(s)"


def cpu_has_bf16() -> bool:
    """Whether this CPU advertises AVX512-BF16 or AMX-BF16 (``/proc/cpuinfo``; False where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def auto_matmul_dtype(device: str) -> str | None:
    """bfloat16 GEMMs on a CPU that has them (transcripts unchanged on the shipped clips), else fp32."""
    return "bfloat16" if torch.device(device).type == "cpu" and cpu_has_bf16() else None


def capacity_row(rec, audio: list, refs: list | None, streams: int, seconds: float, budget_ms: float,
                 chunk_s: float | None = None) -> dict:
    """One run of ``streams`` live lanes of ``seconds`` each on the idle recognizer ``rec``; its row.

    ``rec``: a ``Recognizer`` or anything with its live-stream surface (``play_lanes``; e.g. a
    ``ServedTransducer``). ``refs``: the reference text of each clip of ``audio``, or None (random weights:
    ``wer`` is None). ``chunk_s``: the chunk's seconds (default the ``Recognizer`` engine's)."""
    from oasr.asr.live_source import plan_lanes, play_lanes
    from oasr.asr.metrics import error_rates

    chunk_s = rec.engine.chunk_input_frames * 0.01 if chunk_s is None else chunk_s
    lanes = plan_lanes([len(a) for a in audio], streams, seconds, stagger=chunk_s)
    rec.stage_clock.reset()
    cpu = time.process_time()
    run = play_lanes(rec, audio, lanes, PIECE, timeout=2 * seconds + 10.0)
    cpu = time.process_time() - cpu
    totals = rec.stage_clock.totals()
    chunks = max(1, totals["stream_chunks"])
    lat = run.latencies * 1e3
    p50, p95, p99 = np.percentile(lat, [50, 95, 99]) if len(lat) else (float("nan"),) * 3
    behind = run.timed_out or run.last_delivered - run.last_sent > chunk_s + budget_ms / 1e3
    keys = sorted(run.transcripts)
    wer = None if refs is None else error_rates([refs[lanes[i].clips[k]] for i, k in keys],
                                                [run.transcripts[key].text for key in keys])["wer"]
    row = {"section": "capacity", "case": f"{streams} live streams", "streams": streams,
           "audio_s": float(sum(lane.bounds[-1] for lane in lanes)) / 16000, "chunks": totals["stream_chunks"],
           "latency_p50_ms": float(p50), "latency_p95_ms": float(p95), "latency_p99_ms": float(p99),
           "latency_max_ms": float(lat.max()) if len(lat) else float("nan"),
           "drain_ms": (run.last_delivered - run.last_sent) * 1e3, "max_lag_ms": run.max_lag * 1e3,
           "held": bool(p99 <= budget_ms and not behind), "timed_out": run.timed_out, "wer": wer}
    for stage in STAGES:
        row[f"{stage}_us"] = totals["host_s"][stage] / chunks * 1e6
    row["harness_us"] = run.harness_seconds / chunks * 1e6
    # CPU time of this process (every thread) per stream-chunk, and the streams a core could feed at that
    # cost: on a machine shared with other jobs the wall-clock stages above include waits for a core,
    # the CPU time does not
    row["cpu_us"] = cpu / chunks * 1e6
    row["cpu_bound_streams"] = chunk_s / (cpu / chunks) if cpu else float("inf")
    if totals["device_ms"] is not None:
        for stage, ms in totals["device_ms"].items():
            row[f"dev_{stage}_us"] = ms / chunks * 1e3
        # how close the GPU is to busy: the model step's and the decode's event time over the run's wall time
        row["gpu_busy"] = sum(totals["device_ms"].values()) / 1e3 / max(run.wall_seconds, 1e-9)
    return row


def capacity(device: str = "cpu", latency_budget_ms: float = 250.0, start: int = 16, max_streams: int = 1024,
             seconds: float = 8.0, progress=print, matmul_dtype="auto") -> list[dict]:
    """Double N from ``start`` while N live streams hold the budget; the rows (see the module docstring).

    The last row (``case`` "capacity") names the device and the largest N that held (0 if none).
    ``matmul_dtype``: the recognizer's (``Recognizer(matmul_dtype=)``); "auto": ``auto_matmul_dtype``."""
    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    if start < 1 or max_streams < start or latency_budget_ms <= 0 or seconds <= 0:
        raise ValueError(f"capacity: need 1 <= start <= max_streams, a budget > 0 and seconds > 0, got start={start}, "
                         f"max_streams={max_streams}, latency_budget_ms={latency_budget_ms}, seconds={seconds}")
    clips = load_testset()
    audio = [load_audio(c.path) for c in clips]
    refs = [c.text for c in clips]
    slots = max_streams + max_streams // 4  # a lane's next clip opens while its last chunk is in flight
    matmul_dtype = auto_matmul_dtype(device) if matmul_dtype == "auto" else matmul_dtype
    rec = Recognizer(device=device, max_streams=slots, max_seconds=8.0, matmul_dtype=matmul_dtype)
    capacity_row(rec, audio, refs, min(start, 8), 2.0, latency_budget_ms)  # warm-up: first-use costs
    rows, held, n = [], 0, start
    while n <= max_streams:
        row = capacity_row(rec, audio, refs, n, seconds, latency_budget_ms)
        rows.append(row)
        if progress is not None:
            progress(f"capacity: {n} streams p99 {row['latency_p99_ms']:.0f} ms, held={row['held']}")
        if not row["held"]:
            break
        held, n = n, 2 * n
    rows.append({"section": "capacity", "case": "capacity", "device": device_name(device),
                 "latency_budget_ms": latency_budget_ms, "max_streams_held": held,
                 "matmul": matmul_dtype or "float32", "note": rec.execution_note})
    return rows


def section(quick: bool, device: str = "cpu", latency_budget_ms: float = 250.0, model: str = "shipped",
            lookaheads=None, time_budget_s: float | None = None) -> list[dict]:
    """The bench section: quick (CI) doubles from 16 (CPU) / 64 (CUDA) over 2 s lanes, else from 16 / 64 over 8 s.

    ``model``: "shipped", or a Nemotron configuration of ``oasr.bench.capacity_nemotron.MODELS`` (random weights,
    rows per lookahead, ``lookaheads`` and ``time_budget_s`` as ``nemotron_capacity``'s): quick doubles from 2 to 8
    (CPU) / 64 to 2,048 (CUDA) over 2 s lanes, else from 4 to 256 / 64 to 4,096 over 8 s."""
    cuda = torch.device(device).type == "cuda"
    if model != "shipped":
        from oasr.bench.capacity_nemotron import nemotron_capacity

        if quick:
            start, top, seconds = (64, 2048, 2.0) if cuda else (2, 8, 2.0)
        else:
            start, top, seconds = (64, 4096, 8.0) if cuda else (4, 256, 8.0)
        return nemotron_capacity(device, model, lookaheads, latency_budget_ms, start, top, seconds, time_budget_s,
                                 progress=lambda line: print(line, flush=True))  # a log that outlives a kill
    if quick:
        start, top, seconds = (64, 4096, 2.0) if cuda else (16, 64, 2.0)
    else:
        start, top, seconds = (64, 8192, 8.0) if cuda else (16, 1024, 8.0)
    return capacity(device, latency_budget_ms, start, top, seconds, progress=None)
