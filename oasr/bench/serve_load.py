"""The server under load: N live WebSocket clients against ``python -m oasr serve``, N doubled to a latency budget.

``serve_load(device, latency_budget_ms, start, max_clients, seconds)`` starts ``python -m oasr serve`` as a
child process on 127.0.0.1 for each N (a fresh server, so its ``/health`` percentiles cover that N alone,
``--max-streams N`` unless ``max_streams`` is given) and drives it from this process, which does nothing
else while the clients run: the server and the clients are separate processes, and the row says how much
of one core the clients used (``client_cpu``), so a harness near 1.0 is visible rather than hidden.

Each of the N clients is a *lane* (``oasr.asr.live_source.plan_lanes``): it plays shipped clips back to back
until it has ``seconds`` of audio, lane ``i`` starting ``i / N`` of ``stagger`` seconds after the first. Each
clip is one WebSocket stream through the realtime protocol (``oasr.serve.client.stream_audio``: float32
frames of 40 ms at real time, then a commit); the lane opens its next clip's stream once the last one's final
transcript came. Measured at the client:

* chunk latency: from sending the piece that completed a chunk's audio to receiving its delta;
* time to final: from sending the commit to receiving the completed event;
* refusals (the handshake answered ``503``: no slot within the server's admission timeout) and errors (any
  other refusal, an ``error`` event, a connection that ended without a final transcript, a timeout);
* the WER of the final transcripts against the shipped references (completed streams only).

and from the server (``GET /health`` once the clients are done): its own chunk latency percentiles (audio
that completed a chunk taken by the engine thread -> the tick that encoded it returned), its real-time
factor, and the most streams it held at once (sampled every 0.25 s).

N doubles from ``start`` while a run *holds*: p99 chunk latency within the budget, no refusal, no error,
every stream completed. The row that failed is kept; the last row (``case`` "serve capacity") names the
largest N that held. ``python -m oasr bench --sections serve_load [--latency-budget-ms B] [--quick]``;
``--quick`` (CI): 8 clients, 2 s lanes, one row.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

NOTES = ("latency: client clock, piece that completed a chunk sent -> its delta received, ms; final: commit sent -> "
         "completed event received, ms; server_*: GET /health chunk_latency_ms (the engine thread's clock); "
         "client_cpu: the client process's CPU seconds per wall second (near 1.0: the harness may be the limit); "
         "held: p99 within the budget, no refusal or error, every stream completed")
PIECE_MS = 40
STAGGER_S = 1.28  # lane starts spread over one chunk of the shipped model


@dataclass
class Attempt:
    """One clip of one lane: what its stream returned."""

    lane: int
    clip: int  # index into the audio list
    transcript: str | None = None
    latencies: list = field(default_factory=list)  # seconds per chunk, client clock
    final_s: float | None = None  # commit sent -> completed received
    refused: bool = False  # handshake answered 503
    error: str | None = None


@dataclass
class LoadRun:
    """One run of N clients: every attempt, the wall and client CPU seconds, the server's /health at the end."""

    attempts: list
    wall_s: float
    client_cpu_s: float
    peak_streams: int
    health: dict


async def _lane(url: str, audio: list, index: int, lane, deadline: float, attempts: list) -> None:
    """Play ``lane``'s clips one stream after another, appending an ``Attempt`` per clip."""
    from websockets.exceptions import InvalidStatus

    from oasr.serve.client import stream_audio

    await asyncio.sleep(lane.start)
    for clip in lane.clips:
        attempt = Attempt(index, clip)
        attempts.append(attempt)
        left = deadline - time.perf_counter()
        if left <= 0:
            attempt.error = "not started: the run's timeout passed"
            continue
        try:
            result = await stream_audio(url, audio[clip], piece_ms=PIECE_MS, realtime=True, timeout=left)
        except InvalidStatus as exc:
            status = exc.response.status_code
            attempt.refused = status == 503
            attempt.error = None if attempt.refused else f"handshake refused: HTTP {status}"
            continue
        except (TimeoutError, asyncio.TimeoutError):
            attempt.error = "timed out"
            continue
        except Exception as exc:  # noqa: BLE001 -- a load test counts every failure instead of stopping
            attempt.error = f"{type(exc).__name__}: {exc}"
            continue
        attempt.transcript, attempt.latencies = result.transcript, list(result.latencies)
        if result.errors:
            attempt.error = "; ".join(result.errors)
        elif result.transcript is None:
            attempt.error = f"closed without a final transcript (code {result.close_code})"
        elif result.committed_at is not None and result.completed_at is not None:
            attempt.final_s = result.completed_at - result.committed_at


def run_clients(url: str, audio: list, lanes: list, timeout: float) -> LoadRun:
    """Run one lane per client against the server at ``url`` (http://host:port) until every lane is done or
    ``timeout`` seconds passed (streams still open then are errors); see the module docstring."""
    import httpx

    from oasr.bench.serve import while_watching_peak

    async def run():
        attempts: list = []
        deadline = time.perf_counter() + timeout
        lanes_done = asyncio.gather(*(_lane(url, audio, i, lane, deadline, attempts) for i, lane in enumerate(lanes)))
        _, peak = await while_watching_peak(url, lanes_done, every=0.25)
        return attempts, peak

    cpu, t0 = time.process_time(), time.perf_counter()
    attempts, peak = asyncio.run(run())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    health = httpx.get(url + "/health", timeout=10).json()
    attempts.sort(key=lambda a: (a.lane, a.clip))
    return LoadRun(attempts, wall, cpu, peak, health)


def _percentiles(values_s: list, prefix: str) -> dict:
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    if not len(ms):
        return {f"{prefix}_{p}_ms": float("nan") for p in ("p50", "p95", "p99", "max")}
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {f"{prefix}_p50_ms": float(p50), f"{prefix}_p95_ms": float(p95), f"{prefix}_p99_ms": float(p99),
            f"{prefix}_max_ms": float(ms.max())}


def load_row(run: LoadRun, refs: list, clients: int, audio_s: float, budget_ms: float) -> dict:
    """The row of one run (module docstring); ``refs[clip]`` is the reference text of clip ``clip``."""
    from oasr.asr.metrics import error_rates

    done = [a for a in run.attempts if a.transcript is not None and a.error is None]
    refused = sum(a.refused for a in run.attempts)
    errors = sum(a.error is not None for a in run.attempts)
    row = {"section": "serve_load", "case": f"{clients} clients", "clients": clients,
           "streams": len(run.attempts), "completed": len(done), "refused": refused, "errors": errors,
           "audio_s": audio_s, "wall_s": run.wall_s}
    row.update(_percentiles([x for a in run.attempts for x in a.latencies], "latency"))
    row.update(_percentiles([a.final_s for a in done if a.final_s is not None], "final"))
    row["wer"] = error_rates([refs[a.clip] for a in done], [a.transcript for a in done])["wer"] if done else None
    server = run.health.get("chunk_latency_ms") or {}
    row.update({"server_p50_ms": server.get("p50"), "server_p95_ms": server.get("p95"),
                "server_p99_ms": server.get("p99"), "peak_streams": run.peak_streams,
                "rtf": run.health.get("real_time_factor"), "client_cpu": run.client_cpu_s / max(run.wall_s, 1e-9)})
    p99 = row["latency_p99_ms"]
    row["held"] = bool(p99 <= budget_ms and not refused and not errors and len(done) == len(run.attempts))
    return row


def serve_load(device: str = "cpu", latency_budget_ms: float = 250.0, start: int = 32, max_clients: int = 512,
               seconds: float = 8.0, progress=print, max_streams: int | None = None, server_args=(),
               stagger: float = STAGGER_S, keep_attempts: bool = False) -> list[dict]:
    """Double N from ``start`` while N clients hold the budget (module docstring); one row per N and a last
    ``serve capacity`` row (the largest N that held, 0 if none).

    ``max_streams``: the server's ``--max-streams`` (default N: every client admitted; fewer shows refusals);
    ``server_args``: more ``python -m oasr serve`` options. ``keep_attempts``: each row also carries
    ``attempts``, ``[(lane, clip, transcript or None)]``. ``ValueError`` for ``start < 1``,
    ``max_clients < start``, a budget or ``seconds`` not > 0, ``max_streams < 1``."""
    from oasr.asr.audio import load_audio
    from oasr.asr.live_source import plan_lanes
    from oasr.asr.testset import load_testset
    from oasr.bench.serve import start_server, stop_server

    if not (1 <= start <= max_clients) or not latency_budget_ms > 0 or not seconds > 0 or (
            max_streams is not None and max_streams < 1):
        raise ValueError(f"serve_load: need 1 <= start <= max_clients, a budget > 0, seconds > 0 and max_streams "
                         f">= 1, got start={start}, max_clients={max_clients}, latency_budget_ms={latency_budget_ms}, "
                         f"seconds={seconds}, max_streams={max_streams}")
    clips = load_testset()
    audio = [load_audio(c.path) for c in clips]
    refs = [c.text for c in clips]
    rows, held, n = [], 0, start
    while n <= max_clients:
        lanes = plan_lanes([len(a) for a in audio], n, seconds, stagger=stagger)
        audio_s = float(sum(lane.bounds[-1] for lane in lanes)) / 16000
        proc, url = start_server(max_streams or n, device, extra_args=tuple(server_args))
        try:
            run = run_clients(url, audio, lanes, timeout=2 * seconds + stagger + 60.0)
        finally:
            stop_server(proc)
        row = load_row(run, refs, n, audio_s, latency_budget_ms)
        if keep_attempts:
            row["attempts"] = [(a.lane, a.clip, a.transcript) for a in run.attempts]
        rows.append(row)
        if progress is not None:
            progress(f"serve_load: {n} clients p99 {row['latency_p99_ms']:.0f} ms, refused {row['refused']}, "
                     f"errors {row['errors']}, held={row['held']}")
        if not row["held"]:
            break
        held, n = n, 2 * n
    rows.append({"section": "serve_load", "case": "serve capacity", "device": device,
                 "latency_budget_ms": latency_budget_ms, "max_clients_held": held})
    return rows


def section(quick: bool, device: str = "cpu", latency_budget_ms: float = 250.0) -> list[dict]:
    """The bench section: quick (CI) 8 clients over 2 s lanes; else 32, 64, ... up to 512 over 8 s lanes."""
    start, top, seconds = (8, 8, 2.0) if quick else (32, 512, 8.0)
    return serve_load(device, latency_budget_ms, start, top, seconds, progress=None)
