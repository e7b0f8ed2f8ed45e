"""The server under real clients: ``python -m oasr serve`` in a child process on 127.0.0.1, driven from here.

Two rows, both checked against ``Recognizer().transcribe`` on the same clips (``mismatches``
counts transcripts that differ: 0 is the claim; it is reported, not asserted):

* ``openai client``: every clip uploaded through the official ``openai`` client, 8 at a time;
* ``live clients``: that many WebSocket clients, started together, each streaming one clip in
  real time in 40 ms pieces (``oasr.serve.client.stream_audio``). Latency is per chunk, on the
  client's clock: from sending the piece that completed the chunk's audio to receiving its delta.
  ``peak_streams`` is the most streams the server held at once (``/health``, sampled every 50 ms).
  When the machine cannot keep up with the audio, chunks queue and the latency grows with the
  clip; the numbers say so rather than hide it.

``--quick``: 8 clips and 8 live clients; otherwise all 120 clips and 64 live clients.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

NOTES = ("latency: client clock, piece that completed a chunk sent -> its delta received, ms; server_*: the "
         "server's own clock, the audio completing a chunk taken by the engine's thread -> the tick that encoded it "
         "returned (GET /health chunk_latency_ms); rtf: the server's compute seconds per second of audio; "
         "mismatches: transcripts unlike the offline run (0 expected)")


def start_server(max_streams: int, device: str, timeout: float = 180.0, extra_args=(), env=None,
                 cwd=None) -> tuple[subprocess.Popen, str]:
    """``python -m oasr serve --port 0`` as a child process (1 torch thread; ``extra_args`` appended, ``env``
    added to this process's environment); returns it and its URL, read from its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "oasr", "serve", "--port", "0", "--max-streams", str(max_streams),
                             "--device", device, "--threads", "1", "--log-level", "warning", "--admit-timeout", "60",
                             *extra_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    deadline, lines = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "listening on" in line:
            return proc, line.split("listening on ")[1].strip()
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("python -m oasr serve did not start:\n" + "".join(lines))


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then wait (killed if it does not stop within a minute)."""
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def openai_row(url: str, clips: list, offline: list) -> dict:
    """Every clip through the official client (8 requests in flight); mismatches against ``offline``."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)

    def one(clip):
        with open(clip.path, "rb") as f:
            return client.audio.transcriptions.create(model="oasr", file=f).text

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(one, clips))
    wall = time.perf_counter() - t0
    return {"section": "serve", "case": f"openai client, {len(clips)} clips",
            "mismatches": sum(a != b for a, b in zip(served, offline, strict=True)), "wall_s": wall}


async def while_watching_peak(url: str, work, every: float = 0.05):
    """Await ``work`` (an awaitable) while polling ``url``'s ``/health`` every ``every`` seconds; returns
    ``(work's result, the most streams_active seen)``. A poll that fails is skipped (a busy or restarting
    server), never fatal to the run."""
    import httpx

    peak, done = 0, False

    async def watch():
        nonlocal peak
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            while not done:
                try:
                    peak = max(peak, (await http.get("/health")).json()["streams_active"])
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(every)

    watcher = asyncio.ensure_future(watch())
    try:
        result = await work
    finally:
        done = True
        await watcher
    return result, peak


def live_row(url: str, audio: list, offline: list) -> dict:
    """``len(audio)`` WebSocket clients streaming in real time; latency percentiles, peak streams, mismatches."""
    import httpx

    from oasr.serve.client import stream_audio

    async def run():
        return await while_watching_peak(url, asyncio.gather(
            *(stream_audio(url, pcm, piece_ms=40, realtime=True, timeout=1800) for pcm in audio)))

    t0 = time.perf_counter()
    results, peak = asyncio.run(run())
    wall = time.perf_counter() - t0
    lat = np.array([x for r in results for x in r.latencies]) * 1000
    p50, p95, p99 = np.percentile(lat, [50, 95, 99])
    health = httpx.get(url + "/health", timeout=10).json()
    server = health["chunk_latency_ms"]
    return {"section": "serve", "case": f"{len(audio)} live clients", "mismatches":
            sum(r.transcript != t for r, t in zip(results, offline, strict=True)), "wall_s": wall,
            "audio_s": sum(len(a) for a in audio) / 16000, "rtf": health["real_time_factor"], "latency_p50_ms": p50,
            "latency_p95_ms": p95, "latency_p99_ms": p99, "server_p50_ms": server.get("p50"),
            "server_p95_ms": server.get("p95"), "server_p99_ms": server.get("p99"), "peak_streams": peak}


def section(quick: bool, device: str = "cpu") -> list[dict]:
    """This section's rows (see the module docstring) against a server on ``device``."""
    from oasr.asr.audio import load_audio
    from oasr.asr.recognizer import Recognizer
    from oasr.asr.testset import load_testset

    uploads, live = (8, 8) if quick else (120, 64)
    clips = load_testset(limit=max(uploads, live))
    audio = [load_audio(c.path) for c in clips]
    offline = [t.text for t in Recognizer(device=device, max_streams=16).transcribe(audio)]
    rows = []
    proc, url = start_server(max(8, live), device)
    try:
        rows.append(openai_row(url, clips[:uploads], offline[:uploads]))
    finally:
        stop_server(proc)
    proc, url = start_server(max(8, live), device)  # a fresh server: its RTF covers the live clients alone
    try:
        rows.append(live_row(url, audio[:live], offline[:live]))
    finally:
        stop_server(proc)
    return rows
