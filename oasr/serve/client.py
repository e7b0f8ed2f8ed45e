"""A live-audio client for ``WebSocket /v1/realtime`` (``oasr.serve.protocol``), used by the tests and the bench.

``await stream_audio(url, pcm)`` sends 16 kHz float PCM as 16-bit frames of ``piece_ms``
(at real time with ``realtime=True``), commits, and returns a ``LiveResult``: the final
transcript, every event with its arrival time, and per chunk the latency from the moment the
client sent the audio that completed the chunk to the moment its delta arrived.

Resuming: ``stream_id=`` reconnects to a suspended stream; the server says how much audio it
holds (``samples_received``) and the client sends the rest from there. ``stop_at`` sends only
audio up to that sample and keeps listening without committing (the server's shutdown then
suspends the stream: ``LiveResult.suspended``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from oasr.asr.features import SAMPLE_RATE
from oasr.serve.protocol import REALTIME_PATH, float_to_pcm16


@dataclass
class LiveResult:
    """What one WebSocket session saw (filled in while it runs, so a caller can watch it)."""

    stream_id: str | None = None
    resumed: bool = False
    samples_received: int = 0  # audio the server held when the session started (16 kHz samples)
    transcript: str | None = None  # the completed event's text
    suspended: int | None = None  # samples the server held when it suspended the stream at shutdown
    errors: list = field(default_factory=list)  # error events' messages
    deltas: list = field(default_factory=list)  # delta events, in arrival order
    latencies: list = field(default_factory=list)  # seconds, one per delta of audio this session sent
    close_code: int | None = None


def realtime_url(base_url: str, stream_id: str | None = None) -> str:
    """``ws://host:port/v1/realtime`` from the server's ``http://host:port`` (with ``?stream_id=``)."""
    url = base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + REALTIME_PATH
    return url + (f"?stream_id={stream_id}" if stream_id else "")


async def stream_audio(base_url: str, pcm: np.ndarray, *, piece_ms: int = 40, realtime: bool = False,
                       stream_id: str | None = None, stop_at: int | None = None, result: LiveResult | None = None,
                       close_after_delta: bool = False, timeout: float = 120.0) -> LiveResult:
    """Stream ``pcm`` (16 kHz float) to the server; see the module docstring.

    ``close_after_delta``: close the socket as soon as the first delta arrives (a client that goes
    away mid-stream). ``timeout`` bounds the whole session (``TimeoutError``).
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    result = result if result is not None else LiveResult()
    piece = max(1, piece_ms * SAMPLE_RATE // 1000)
    sent_at: list = []  # (end sample, time) of every piece sent

    async def send(ws, start: int) -> None:
        end = len(pcm) if stop_at is None else min(stop_at, len(pcm))
        t0 = time.perf_counter()
        for k, first in enumerate(range(start, end, piece)):
            if realtime:
                await asyncio.sleep(max(0.0, t0 + k * piece / SAMPLE_RATE - time.perf_counter()))
            last = min(first + piece, end)
            await ws.send(float_to_pcm16(pcm[first:last]))
            sent_at.append((last, time.perf_counter()))
        if stop_at is None:
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

    async def session() -> None:
        async with connect(realtime_url(base_url, stream_id), max_size=None) as ws:
            created = json.loads(await ws.recv())
            if created.get("type") != "transcription_session.created":
                raise RuntimeError(f"expected transcription_session.created, got {created}")
            info = created["session"]
            result.stream_id, result.resumed = info["id"], info["resumed"]
            result.samples_received = info["samples_received"]
            sender = asyncio.ensure_future(send(ws, result.samples_received))
            try:
                async for message in ws:
                    now = time.perf_counter()
                    event = json.loads(message)
                    kind = event.get("type")
                    if kind == "conversation.item.input_audio_transcription.delta":
                        result.deltas.append(event)
                        covered = event["audio_end_ms"] * SAMPLE_RATE // 1000
                        sent = next((t for end, t in sent_at if end >= covered), sent_at[-1][1] if sent_at else None)
                        if sent is not None and covered > result.samples_received:
                            result.latencies.append(now - sent)
                        if close_after_delta:
                            break
                    elif kind == "conversation.item.input_audio_transcription.completed":
                        result.transcript = event["transcript"]
                    elif kind == "transcription_session.suspended":
                        result.suspended = event["session"]["samples_received"]
                    elif kind == "error":
                        result.errors.append(event["error"]["message"])
            except ConnectionClosed:
                pass
            finally:
                sender.cancel()
            result.close_code = ws.close_code

    await asyncio.wait_for(session(), timeout)
    return result
