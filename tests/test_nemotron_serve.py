"""``python -m oasr serve --model DIR``: a Nemotron streaming checkpoint behind the server, equal to transformers.

A tiny random checkpoint (``nemotron_rnnt_oracle.make_checkpoint``: its joint biased so that it emits tokens) is
served through ``ServedTransducer`` (``oasr.asr.transducer_serving``), the ``Recognizer``-like surface the
``EngineWorker`` drives. The official ``openai`` client's ``audio.transcriptions.create`` and the WebSocket path
must return exactly the text of transformers' streaming generation on the same audio at the same lookahead.
The stream API's suspend / checkpoint / resume (what the server's shutdown and crash recovery use) are checked
against the uninterrupted text.
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
pytest.importorskip("websockets")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronAsrStreamingForRNNT"):
    pytest.skip(f"transformers {transformers.__version__} has no NemotronAsrStreamingForRNNT", allow_module_level=True)

from oasr.asr.transducer import TransducerRecognizer  # noqa: E402
from oasr.asr.transducer_serving import ServedTransducer  # noqa: E402
from oasr.serve import protocol  # noqa: E402
from oasr.serve.app import ServeOptions, ServerThread, create_app  # noqa: E402
from oasr.serve.client import stream_audio  # noqa: E402
from oasr.serve.worker import EngineWorker  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import nemotron_rnnt_oracle as oracle  # noqa: E402

TIMEOUT = 120.0
CLIPS = [(0, 1.3), (4, 0.9), (2, 0.5)]


def oracle_text(model, processor, directory, pcm, lookahead) -> str:
    """transformers' streaming generation's text for ``pcm`` (oasr's NeMo log-mel, equal to transformers' own
    feature extractor as tests/test_feature_frontends.py shows)."""
    import torch

    from oasr.features import NemoMel

    feats = torch.from_numpy(NemoMel.from_checkpoint(directory).extract(pcm))
    *_, sequence = oracle.oracle_stream(model, feats, lookahead)
    return processor.decode(sequence, skip_special_tokens=True)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("nemoserve")
    ckpt = root / "ckpt"
    model, processor = oracle.make_checkpoint(ckpt, "a", seed=11)
    audio, wavs = [], []
    for i, (index, seconds) in enumerate(CLIPS):
        pcm = oracle.clip(index, seconds)
        path = root / f"clip{i}.wav"
        sf.write(path, pcm, 16000, subtype="FLOAT")
        audio.append(pcm)
        wavs.append(path)
    lookahead = processor.default_num_lookahead_tokens
    want = [oracle_text(model, processor, ckpt, pcm, lookahead) for pcm in audio]
    assert all(want) and len(set(want)) == len(want)  # the biased joint emits text; the clips differ
    return ckpt, audio, wavs, want


@pytest.fixture(scope="module")
def server(made):
    ckpt = made[0]
    rec = ServedTransducer(TransducerRecognizer(ckpt, max_batch_size=4))
    srv = ServerThread(create_app(EngineWorker(rec, admit_timeout=30.0), ServeOptions(max_audio_seconds=30.0)))
    yield srv
    srv.stop()


def test_openai_client_returns_transformers_text(server, made):
    _, _, wavs, want = made
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=TIMEOUT, max_retries=0)

    def one(path):
        with open(path, "rb") as f:
            return client.audio.transcriptions.create(model="oasr", file=f).text

    with ThreadPoolExecutor(3) as pool:  # concurrent uploads share the engine's ticks (one cohort)
        served = list(pool.map(one, wavs))
    assert served == want
    with open(wavs[0], "rb") as f:
        verbose = client.audio.transcriptions.create(model="oasr", file=f, response_format="verbose_json")
    assert verbose.text == want[0] and verbose.duration == pytest.approx(CLIPS[0][1], abs=1e-3)


def test_websocket_returns_transformers_text(server, made):
    _, audio, _, want = made

    async def run():
        return await asyncio.gather(*(stream_audio(server.url, pcm, piece_ms=100, timeout=TIMEOUT) for pcm in audio))

    results = asyncio.run(run())
    assert [r.transcript for r in results] == want
    for r in results:
        assert r.close_code == protocol.CLOSE_NORMAL and not r.errors and r.deltas
    import httpx

    health = httpx.get(server.url + "/health", timeout=10).json()  # the worker's stats from the served transducer
    assert health["chunk_latency_ms"]["chunks"] > 0 and health["pool"]["slots_total"] == 4
    assert health["pool"]["blocks_total"] > 0
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def _feed(served, sid, pcm, start, stop, piece=1600):
    for i in range(start, stop, piece):
        served.streams[sid].accept(pcm[i : min(i + piece, stop)])
        served.step()


def _finish(served, sid) -> str:
    served.streams[sid].end()
    for _ in range(1000):
        for transcript in served.step():
            if transcript.id == sid:
                served.engine.cancel(sid)
                return transcript.text
    raise AssertionError("the stream did not finish")


@pytest.mark.parametrize("cut", [800, 9600])  # before the encoder admits the stream (under a first chunk), and after
def test_suspend_checkpoint_resume_give_the_uninterrupted_text(made, cut):
    ckpt, audio, _, want = made
    pcm = audio[0]
    served = ServedTransducer(TransducerRecognizer(ckpt, max_batch_size=2))
    served.open_stream("x")
    _feed(served, "x", pcm, 0, cut)
    saved = served.checkpoint("x")  # the stream goes on here
    assert served.engine.status("x") in ("waiting", "active") and "x" in served.streams
    _feed(served, "x", pcm, cut, len(pcm))
    assert _finish(served, "x") == want[0]
    assert served.pool_usage()["slots_used"] == 0 and not served.engine.stream_ids

    other = ServedTransducer(TransducerRecognizer(ckpt, max_batch_size=2))  # after a crash: the checkpoint
    stream = other.resume(saved, "y")
    assert stream.samples == cut
    _feed(other, "y", pcm, cut, len(pcm))
    assert _finish(other, "y") == want[0]

    third = ServedTransducer(TransducerRecognizer(ckpt, max_batch_size=2))  # shutdown: suspend, resume elsewhere
    third.open_stream("z")
    _feed(third, "z", pcm, 0, cut)
    blob = third.suspend("z")
    assert "z" not in third.streams and third.pool_usage()["slots_used"] == 0
    third.resume(blob, "z")
    _feed(third, "z", pcm, cut, len(pcm))
    assert _finish(third, "z") == want[0]
    with pytest.raises(ValueError, match="not a suspended stream"):
        third.resume(b"junk", "w")


def test_serve_command_takes_a_checkpoint_directory(made, monkeypatch, capsys):
    """``serve --model DIR`` builds the served transducer (the server itself is replaced by a stub here)."""
    from oasr.commands import serve
    from oasr.serve import app

    ran = {}

    class NoServer:
        def __init__(self, config, **kwargs):
            ran["app"] = config.app

        def run(self):
            ran["run"] = True

    monkeypatch.setattr(app, "OasrServer", NoServer)
    assert serve.main(["--model", str(made[0]), "--lookahead", "1", "--max-streams", "3", "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert ran["run"] and "3 stream slots" in out and "lookahead 1 (160 ms chunks)" in out
    np.testing.assert_equal(len(out.splitlines()), 1)


def test_shutdown_suspends_a_live_stream_and_a_new_server_resumes_it(made, tmp_path):
    """The server's shutdown path with a transducer: a live stream is suspended into the state directory, a new
    server on the directory resumes it when the client reconnects with its id, and the text is transformers'."""
    import time

    from oasr.serve.client import LiveResult

    ckpt, audio, _, want = made
    pcm = audio[0]

    def start():
        rec = ServedTransducer(TransducerRecognizer(ckpt, max_batch_size=2))
        worker = EngineWorker(rec, admit_timeout=30.0, state_dir=tmp_path)
        return ServerThread(create_app(worker, ServeOptions(max_audio_seconds=30.0)))

    srv = start()

    async def first_half():
        result = LiveResult()
        task = asyncio.ensure_future(stream_audio(srv.url, pcm, stop_at=len(pcm) // 2, result=result, piece_ms=100,
                                                  timeout=TIMEOUT))
        deadline = time.monotonic() + TIMEOUT
        while not result.deltas and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # a chunk has been encoded and decoded
        await asyncio.to_thread(srv.stop)  # as on SIGTERM: live streams are suspended
        await task
        return result

    half = asyncio.run(first_half())
    assert half.close_code == protocol.CLOSE_SERVICE_RESTART and half.transcript is None
    assert 0 < half.suspended <= len(pcm) // 2
    assert [p.stem for p in tmp_path.glob("*.session")] == [half.stream_id]
    srv = start()
    try:
        rest = asyncio.run(stream_audio(srv.url, pcm, stream_id=half.stream_id, piece_ms=100, timeout=TIMEOUT))
    finally:
        srv.stop()
    assert rest.resumed and rest.samples_received == half.suspended
    assert rest.transcript == want[0]
