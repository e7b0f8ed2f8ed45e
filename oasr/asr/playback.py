"""Audio played into a recognizer as live sources: staggered streams pushed piece by piece, at real time or as
fast as the engine goes. The demo, the speech bench and the capacity bench drive the engine through it."""

from __future__ import annotations

import time

import numpy as np


def play(rec, audio: list, concurrency: int, piece: int, realtime: bool) -> tuple[list, dict]:
    """Stream ``audio`` (16 kHz arrays) through ``rec`` as staggered live sources; transcripts in order.

    Sources start ``mean clip length / concurrency`` apart and send one ``piece`` (samples) per
    ``piece / 16000`` s of their clock: the wall clock (``realtime``) or a virtual one that moves a
    piece per round and never waits, so about ``concurrency`` streams are live at once either way.
    The run dict holds ``wall_seconds``, ``peak_streams`` and, for a plot, ``timeline`` (per round:
    clock seconds, streams held, pool blocks in use) and ``latencies`` (per chunk: clock seconds, latency
    seconds).
    """
    rate = 16000
    mean = float(np.mean([len(a) for a in audio])) / rate
    starts = [i * mean / concurrency for i in range(len(audio))]
    results, live, peak = {}, {}, 0
    timeline, chunk_latencies, seen = [], [], {}
    t0 = time.perf_counter()
    virtual = 0.0
    next_clip = 0
    while next_clip < len(audio) or live or rec.streams:
        now = (time.perf_counter() - t0) if realtime else virtual
        while next_clip < len(audio) and starts[next_clip] <= now:
            live[rec.open_stream().id] = [next_clip, 0]
            next_clip += 1
        t_feed = time.perf_counter()
        for sid, entry in list(live.items()):
            index, fed = entry
            pcm = audio[index]
            due = min(len(pcm), int((now - starts[index]) * rate) // piece * piece)
            while fed < due:  # one push per piece, as a live source sends them
                rec.streams[sid].accept(pcm[fed : fed + piece])
                fed += piece
            entry[1] = fed
            if fed >= len(pcm) and not rec.engine.input_ended(sid):
                rec.streams[sid].end()
        rec.busy_seconds += time.perf_counter() - t_feed
        peak = max(peak, len(rec.streams))
        while True:  # every chunk that is ready now
            done = rec.step()
            for transcript in done:
                results[live.pop(transcript.id)[0]] = transcript
                chunk_latencies += [(now, x) for x in transcript.latencies[seen.pop(transcript.id, 0):]]
            for sid, stream in rec.streams.items():
                chunk_latencies += [(now, x) for x in stream.latencies[seen.get(sid, 0):]]
                seen[sid] = len(stream.latencies)
            if not rec.engine.stats[-1].cohort and not done:
                break
        timeline.append((now, len(rec.streams), rec.engine.stats[-1].used_blocks if rec.engine.stats else 0))
        if realtime:
            wake = now + piece / rate  # the next piece is due, or the next stream starts, whichever is first
            if next_clip < len(audio):
                wake = min(wake, starts[next_clip])
            time.sleep(max(0.0, t0 + wake - time.perf_counter()))
        else:
            virtual = now + piece / rate
    wall = time.perf_counter() - t0
    return [results[i] for i in range(len(audio))], {"wall_seconds": wall, "peak_streams": peak,
                                                     "timeline": timeline, "latencies": chunk_latencies}
