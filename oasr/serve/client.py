"""A live-audio client for ``WebSocket /v1/realtime`` (``oasr.serve.protocol``), used by the tests and the bench.

``stream_audio`` is a coroutine: ``asyncio.run(stream_audio(url, pcm))`` from plain code, ``await``
inside an event loop. It sends 16 kHz float PCM in frames of ``piece_ms`` (at real time with
``realtime=True``), commits, and returns a ``LiveResult``: the final transcript, every event, and
per chunk the latency from the moment the client sent the audio that completed the chunk to the
moment its delta arrived.

Frames are ``float32`` by default (``audio_format``): the samples reach the engine bit for bit, so
the transcript equals an upload's of the same audio. ``pcm16`` (OpenAI's format) rounds each
sample to 16 bits first; for audio that was not 16-bit PCM at 16 kHz (a resampled file) that can
change the transcript.

Resuming: ``stream_id=`` reconnects to a saved stream. The server says how much audio it holds
(``samples_received``) and the client sends ``pcm`` from that sample on, skipping what the server
already has: pass the whole utterance, not the rest. ``reconnect=S``: when the connection drops
before the final transcript (the server was stopped, crashed or restarted: close 1012, 1006, a
refused connection), keep trying for ``S`` seconds to reconnect with the stream's id and go on from
the server's ``samples_received`` (its last checkpoint after a crash); a server that has no session
for the id (404: it crashed before the first checkpoint) gets the utterance again from its start as
a new stream. ``stop_at`` sends only audio up to that sample and keeps listening without committing
(the server's shutdown then suspends the stream: ``LiveResult.suspended``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from oasr.features.fbank import SAMPLE_RATE
from oasr.serve.protocol import CLOSE_NORMAL, REALTIME_PATH, float_to_float32, float_to_pcm16

ENCODERS = {"float32": float_to_float32, "pcm16": float_to_pcm16}


@dataclass
class LiveResult:
    """What one stream saw (filled in while it runs, so a caller can watch it)."""

    stream_id: str | None = None
    resumed: bool = False  # the last connection resumed a saved stream
    samples_received: int = 0  # audio the server held when the last connection started (16 kHz samples)
    transcript: str | None = None  # the completed event's text
    suspended: int | None = None  # samples the server held when it suspended the stream at shutdown
    errors: list = field(default_factory=list)  # error events' messages
    deltas: list = field(default_factory=list)  # delta events, in arrival order (all connections)
    latencies: list = field(default_factory=list)  # seconds, one per delta of audio this session sent
    close_code: int | None = None
    connections: list = field(default_factory=list)  # (stream id, resumed, samples_received) of each connection
    committed_at: float | None = None  # time.perf_counter when the commit was sent (the last connection's)
    completed_at: float | None = None  # time.perf_counter when the completed event arrived
    # turn_detection: (connection number, event) of every speech_started / speech_stopped / completed event, and
    # the completed turns' texts by item id (a turn completed again after a resume replaces its first copy)
    turn_events: list = field(default_factory=list)
    turns: dict = field(default_factory=dict)


def realtime_url(base_url: str, stream_id: str | None = None, audio_format: str = "pcm16",
                 turn_detection: str | None = None) -> str:
    """``ws://host:port/v1/realtime`` from the server's ``http://host:port`` (with ``?stream_id=``, the format
    and ``turn_detection``)."""
    url = base_url.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + REALTIME_PATH
    query = ([f"stream_id={stream_id}"] if stream_id else []) + (
        [f"input_audio_format={audio_format}"] if audio_format != "pcm16" else []) + (
        [f"turn_detection={turn_detection}"] if turn_detection else [])
    return url + ("?" + "&".join(query) if query else "")


async def stream_audio(base_url: str, pcm: np.ndarray, *, piece_ms: int = 40, realtime: bool = False,
                       stream_id: str | None = None, stop_at: int | None = None, result: LiveResult | None = None,
                       close_after_delta: bool = False, timeout: float = 120.0, reconnect: float = 0.0,
                       audio_format: str = "float32", turn_detection: str | None = None) -> LiveResult:
    """Stream ``pcm`` (the whole utterance, 16 kHz float) to the server; see the module docstring.

    ``close_after_delta``: close the socket as soon as the first delta arrives (a client that goes
    away mid-stream). ``timeout`` bounds the whole call (``TimeoutError``); ``reconnect`` is the
    longest it keeps retrying after one lost connection. ``turn_detection="server_vad"``: the server cuts the
    stream into turns; ``LiveResult.turn_events`` and ``turns`` collect them, and ``transcript`` is the turns'
    texts joined once the server closes the session normally.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

    if audio_format not in ENCODERS:
        raise ValueError(f"audio_format must be one of {', '.join(ENCODERS)}, got {audio_format!r}")
    encode = ENCODERS[audio_format]
    result = result if result is not None else LiveResult()
    piece = max(1, piece_ms * SAMPLE_RATE // 1000)

    async def session(sid: str | None) -> bool:
        """One connection; True when the stream is over (completed, suspended by intent, closed by us)."""
        sent_at: list = []  # (end sample, time) of every piece sent on this connection

        async def send(ws, start: int) -> None:
            end = len(pcm) if stop_at is None else min(stop_at, len(pcm))
            t0 = time.perf_counter()
            for k, first in enumerate(range(start, end, piece)):
                if realtime:
                    await asyncio.sleep(max(0.0, t0 + k * piece / SAMPLE_RATE - time.perf_counter()))
                last = min(first + piece, end)
                await ws.send(encode(pcm[first:last]))
                sent_at.append((last, time.perf_counter()))
            if stop_at is None:
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                result.committed_at = time.perf_counter()

        async with connect(realtime_url(base_url, sid, audio_format, turn_detection), max_size=None) as ws:
            created = json.loads(await ws.recv())
            if created.get("type") != "transcription_session.created":
                raise RuntimeError(f"expected transcription_session.created, got {created}")
            info = created["session"]
            result.stream_id, result.resumed = info["id"], info["resumed"]
            result.samples_received = info["samples_received"]
            result.connections.append((info["id"], info["resumed"], info["samples_received"]))
            sender = asyncio.ensure_future(send(ws, result.samples_received))
            closed_by_us = False
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
                            closed_by_us = True
                            break
                    elif kind == "conversation.item.input_audio_transcription.completed" and turn_detection:
                        result.turn_events.append((len(result.connections) - 1, event))
                        result.turns[event["item_id"]] = event["transcript"]
                    elif kind == "conversation.item.input_audio_transcription.completed":
                        result.transcript, result.completed_at = event["transcript"], now
                    elif str(kind).startswith("input_audio_buffer.speech_"):
                        result.turn_events.append((len(result.connections) - 1, event))
                    elif kind == "transcription_session.suspended":
                        result.suspended = event["session"]["samples_received"]
                    elif kind == "error":
                        result.errors.append(event["error"]["message"])
            except ConnectionClosed:
                pass
            finally:
                sender.cancel()
            result.close_code = ws.close_code
            if turn_detection and result.close_code == CLOSE_NORMAL and stop_at is None:
                result.transcript = " ".join(text for text in result.turns.values() if text)
        return closed_by_us or result.transcript is not None or result.close_code == CLOSE_NORMAL or (
            result.suspended is not None and stop_at is not None)

    async def run() -> None:
        sid, lost_at = stream_id, None  # lost_at: when the connection dropped (None: not lost yet)
        while True:
            try:
                if await session(sid) or not reconnect:
                    return  # over, or dropped and not to be resumed (the caller reads close_code)
                sid, result.suspended, lost_at = result.stream_id, None, time.monotonic()
                continue  # reconnect with the stream's id at once
            except InvalidStatus as exc:
                status = exc.response.status_code
                if lost_at is None:
                    raise  # the first connection was refused: the caller's request
                if status == 404:  # no session saved for the id: the utterance again, as a new stream
                    sid, result.samples_received = None, 0
                    continue
                if status not in (409, 503):
                    raise
            except (OSError, InvalidHandshake, ConnectionClosed):  # not listening (yet), or died mid-handshake
                if lost_at is None:
                    raise
            if time.monotonic() - lost_at > reconnect:
                raise ConnectionError(f"could not reconnect to stream {sid!r} within {reconnect:g} s")
            await asyncio.sleep(0.2)

    await asyncio.wait_for(run(), timeout)
    return result
