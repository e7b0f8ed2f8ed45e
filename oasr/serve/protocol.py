"""The wire formats of ``python -m oasr serve``: what goes in, what comes out, and the refusals.

Uploads (``POST /v1/audio/transcriptions``) follow OpenAI's transcription API; live audio
(``WebSocket /v1/realtime``) follows the shape of OpenAI's realtime transcription events. Every
message this server sends is built here, so the protocol can be read in one place (and in
docs/serving.md).

WebSocket session, client -> server:

* binary frames: mono PCM at the session's sample rate (``?sample_rate=``, default 16000; another
  rate in [8000, 192000] is resampled message by message), in the session's
  ``?input_audio_format=``: ``pcm16`` (default, OpenAI's: 16-bit little-endian) or ``float32``
  (32-bit little-endian IEEE floats in [-1, 1]: the samples reach the engine bit for bit, so a
  stream transcribes exactly as an upload of the same audio);
* ``{"type": "input_audio_buffer.append", "audio": "<base64 of the same PCM bytes>"}``;
* ``{"type": "input_audio_buffer.commit"}``: the audio has ended; the final transcript follows.

Server -> client (JSON text frames):

* ``transcription_session.created``: ``session.id`` (the stream id, kept for a reconnect),
  ``session.resumed``, ``session.samples_received`` (the audio the server holds, in samples at
  16 kHz: a resumed client sends the rest from there; after a crash that is the last checkpoint's,
  which may be less than the client had sent);
* ``conversation.item.input_audio_transcription.delta``: one per encoded chunk: ``delta`` (text
  to append, possibly empty), ``text`` (the whole partial transcript, which the beam search may
  revise) and ``audio_end_ms`` (the audio it covers);
* ``conversation.item.input_audio_transcription.completed``: ``transcript``, the final text; the
  server then closes the socket (code 1000);
* ``transcription_session.suspended``: the server is shutting down and saved the stream; it closes
  with code 1012 (service restart). Reconnect with ``?stream_id=<session.id>`` to continue;
* with ``?turn_detection=server_vad`` the stream is cut into turns by the endpointer over the CTC
  speech probability (``oasr.asr.turns``): per turn ``input_audio_buffer.speech_started``
  (``audio_start_ms``), its deltas, ``input_audio_buffer.speech_stopped`` (``audio_end_ms``) and one
  ``conversation.item.input_audio_transcription.completed`` (``transcript``: the turn's text, with
  ``audio_start_ms`` / ``audio_end_ms``); each turn's ``item_id`` is ``<session id>-turn<N>`` (N from 0),
  and the deltas of a turn carry its item id and its text alone. After the commit the last turn
  completes and the server closes (code 1000) without a whole-stream completed event;
* ``error``: ``error.code`` and ``error.message``; the session stays open unless it cannot go on:
  ``stream_failed`` (an internal error ended this stream; the server goes on) and ``server_error``
  are followed by close code 1011.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np

from oasr.asr.audio import AudioError, read_bytes
from oasr.features.fbank import SAMPLE_RATE

TRANSCRIPTION_PATH = "/v1/audio/transcriptions"
REALTIME_PATH = "/v1/realtime"
RESPONSE_FORMATS = ("json", "text", "verbose_json")
TURN_DETECTION = "server_vad"  # ?turn_detection= of a WebSocket session
SESSION_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
CLOSE_NORMAL, CLOSE_SERVICE_RESTART, CLOSE_TRY_AGAIN, CLOSE_POLICY = 1000, 1012, 1013, 1008
CLOSE_INTERNAL_ERROR = 1011
INPUT_AUDIO_FORMATS = ("pcm16", "float32")


class RequestError(ValueError):
    """A request this server refuses: ``status`` (HTTP), ``code`` (a short name) and a message that says
    what was expected and what came."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param

    def body(self) -> dict:
        """The error in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def decode_upload(data: bytes, name: str = "upload", max_seconds: float | None = None) -> np.ndarray:
    """Mono float32 PCM at 16 kHz from the bytes of an uploaded audio file (any format libsndfile reads).

    ``oasr.asr.audio.load_audio``'s reading and checks (downmix and resampling included), as
    ``RequestError``: 400 for an empty file, one soundfile cannot read, a truncated one or a rate out
    of range; 413 for audio longer than ``max_seconds``.
    """
    if not data:
        raise RequestError(400, "empty_file", f"{name}: the file is empty (0 bytes); expected an audio file",
                           "file")
    try:
        pcm = read_bytes(data, name)  # several channels are mixed down, as for a file
    except AudioError as exc:
        raise RequestError(400, "invalid_audio", str(exc), "file") from None
    check_duration(len(pcm), max_seconds, name)
    return pcm


def check_duration(samples: int, max_seconds: float | None, what: str) -> None:
    """413 ``RequestError`` when ``samples`` at 16 kHz are more than ``max_seconds`` of audio."""
    if max_seconds is not None and samples > max_seconds * SAMPLE_RATE:
        raise RequestError(413, "audio_too_long", f"{what}: {samples / SAMPLE_RATE:.1f} s of audio, this server "
                           f"takes at most {max_seconds:g} s per stream", "file")


def pcm16_to_float(data: bytes) -> np.ndarray:
    """Samples in [-1, 1) from 16-bit little-endian PCM bytes (``RequestError`` for an odd byte count)."""
    if len(data) % 2:
        raise RequestError(400, "invalid_audio", f"PCM frames are 16-bit samples: expected an even number of "
                           f"bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def float_to_pcm16(pcm: np.ndarray) -> bytes:
    """16-bit little-endian PCM bytes of float samples in [-1, 1] (clipped): what a live client sends."""
    return (np.clip(np.asarray(pcm, np.float32), -1.0, 32767 / 32768) * 32768.0).round().astype("<i2").tobytes()


def float32_to_float(data: bytes) -> np.ndarray:
    """Samples from 32-bit little-endian float bytes (``RequestError`` for a byte count not a multiple of 4)."""
    if len(data) % 4:
        raise RequestError(400, "invalid_audio", f"float32 frames are 4-byte samples: expected a multiple of 4 "
                           f"bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<f4").astype(np.float32)


def float_to_float32(pcm: np.ndarray) -> bytes:
    """32-bit little-endian float bytes of ``pcm`` (what a live client sends with ``input_audio_format=float32``)."""
    return np.asarray(pcm, np.float32).astype("<f4").tobytes()


def decode_frame(data: bytes, audio_format: str) -> np.ndarray:
    """Float samples of one client audio frame in the session's ``input_audio_format``."""
    return float32_to_float(data) if audio_format == "float32" else pcm16_to_float(data)


def model_card(name: str) -> dict:
    """One entry of ``GET /v1/models`` (OpenAI's model object)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "oasr"}


def parse_client_message(text: str) -> tuple[str, bytes | None]:
    """``(type, pcm bytes or None)`` of a client's JSON text frame (``RequestError`` for anything else)."""
    try:
        message = json.loads(text)
    except ValueError:
        raise RequestError(400, "invalid_message", f"text frames must be JSON objects, got {text[:80]!r}") from None
    kind = message.get("type") if isinstance(message, dict) else None
    if kind == "input_audio_buffer.append":
        audio = message.get("audio")
        if not isinstance(audio, str):
            raise RequestError(400, "invalid_message", "input_audio_buffer.append needs 'audio', base64 PCM16")
        try:
            return kind, base64.b64decode(audio, validate=True)
        except ValueError:
            raise RequestError(400, "invalid_message", "input_audio_buffer.append: 'audio' is not base64") from None
    if kind == "input_audio_buffer.commit":
        return kind, None
    raise RequestError(400, "invalid_message", f"unknown message type {kind!r}; expected input_audio_buffer.append "
                       "or input_audio_buffer.commit (or binary PCM16 frames)")


class DeltaText:
    """Turns a revisable partial transcript into append-only deltas, as OpenAI's streams send text.

    The beam search may revise the tail of its partial hypothesis, so only words followed by
    another word are sent (the last word may still grow or change). A delta is sent only when the
    stable words extend what was sent; a revision of words already sent waits for the final text.
    ``sent`` is the concatenation of every delta so far; it equals the final text unless a word
    already sent was revised, and the final (done / completed) event's text is the transcript.
    """

    def __init__(self):
        self.sent = ""

    def update(self, text: str, final: bool = False) -> str:
        """The delta to send for the partial ``text`` (the whole final text when ``final``)."""
        stable = text if final else text[: text.rfind(" ") + 1]
        if not stable.startswith(self.sent):
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta


def upload_event_delta(delta: str, text: str, audio_end_ms: int) -> dict:
    """An SSE event of a streamed upload (OpenAI's ``transcript.text.delta``, plus ``text`` and ``audio_end_ms``)."""
    return {"type": "transcript.text.delta", "delta": delta, "text": text, "audio_end_ms": audio_end_ms}


def upload_event_done(text: str, seconds: float) -> dict:
    """The last SSE event of a streamed upload (OpenAI's ``transcript.text.done``)."""
    return {"type": "transcript.text.done", "text": text,
            "usage": {"type": "duration", "seconds": round(seconds, 3)}}


def sse(event: dict) -> str:
    """One server-sent event carrying ``event`` as JSON."""
    return f"data: {json.dumps(event)}\n\n"


def parse_granularities(values, response_format: str) -> tuple:
    """The ``timestamp_granularities[]`` of an upload (``segment`` and/or ``word``; default ``segment``), as
    OpenAI takes them: only with verbose_json. ``RequestError`` for another value or response format."""
    chosen = tuple(dict.fromkeys(str(v) for v in values)) or ("segment",)
    bad = [v for v in chosen if v not in ("segment", "word")]
    if bad:
        raise RequestError(400, "invalid_timestamp_granularities", f"timestamp_granularities[] takes 'segment' "
                           f"and 'word', got {bad[0][:40]!r}", "timestamp_granularities")
    if values and response_format != "verbose_json":
        raise RequestError(400, "invalid_timestamp_granularities", f"timestamp_granularities[] needs "
                           f"response_format=verbose_json, got {response_format!r}", "timestamp_granularities")
    return chosen


def transcription_body(transcript, response_format: str, model: str, tokens: list | None = None,
                       granularities: tuple = ("segment",)) -> dict | str:
    """The response to a finished upload in ``response_format`` (json, text or verbose_json).

    verbose_json has one segment per utterance, from 0 to the audio's end, with the times at which
    each partial text was reached (``partials``, an extra field: seconds of audio, text); an upload cut
    into turns (``chunking_strategy``) has one segment per turn with its times instead. With ``word``
    among ``granularities`` it also carries ``words`` (word, start, end) from the CTC alignment
    (``oasr.asr.words``; empty when rescoring changed the first pass's tokens).
    """
    if response_format == "text":
        return transcript.text + "\n"
    seconds = transcript.audio_seconds
    usage = {"type": "duration", "seconds": round(seconds, 3)}
    if response_format == "json":
        return {"text": transcript.text, "usage": usage}
    turns = getattr(transcript, "segments", None)
    if turns:  # the upload was cut into turns (chunking_strategy): one segment per turn, with its times
        segments = [{"id": i, "seek": 0, "start": seg.start, "end": seg.end, "text": seg.text, "tokens": [],
                     "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 1.0, "no_speech_prob": 0.0}
                    for i, seg in enumerate(turns)]
    else:
        segments = [{"id": 0, "seek": 0, "start": 0.0, "end": round(seconds, 3), "text": transcript.text,
                     "tokens": list(tokens or []), "temperature": 0.0, "avg_logprob": 0.0, "compression_ratio": 1.0,
                     "no_speech_prob": 0.0,
                     "partials": [[round(t, 3), text] for t, text in transcript.partials]}]
        segments = segments if transcript.text else []
    body = {"task": "transcribe", "language": "english", "duration": round(seconds, 3), "text": transcript.text,
            "segments": segments, "usage": usage, "model": model}
    if "word" in granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in getattr(transcript, "words", [])]
    if "segment" not in granularities:
        del body["segments"]
    return body


def parse_chunking_strategy(value) -> bool:
    """Whether an upload's ``chunking_strategy`` form field asks for turns: ``auto`` or a JSON object of
    ``"type": "server_vad"`` (its other knobs are not taken: the server's endpointer decides); absent: no.
    ``RequestError`` for anything else."""
    if value in (None, ""):
        return False
    if value == "auto":
        return True
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and parsed.get("type") == TURN_DETECTION:
        return True
    raise RequestError(400, "invalid_chunking_strategy", f"chunking_strategy must be 'auto' or a JSON object with "
                       f"\"type\": \"{TURN_DETECTION}\", got {str(value)[:80]!r}", "chunking_strategy")


def ws_session_created(stream_id: str, resumed: bool, samples: int, audio_format: str = "pcm16") -> dict:
    """The first server event of a WebSocket session."""
    return {"type": "transcription_session.created",
            "session": {"id": stream_id, "resumed": resumed, "samples_received": samples,
                        "input_audio_format": audio_format, "sample_rate": SAMPLE_RATE}}


def ws_delta(stream_id: str, delta: str, text: str, audio_end_ms: int) -> dict:
    """A partial transcript of a WebSocket session (one per encoded chunk)."""
    return {"type": "conversation.item.input_audio_transcription.delta", "item_id": stream_id, "content_index": 0,
            "delta": delta, "text": text, "audio_end_ms": audio_end_ms}


def ws_completed(stream_id: str, text: str, seconds: float) -> dict:
    """The final transcript of a WebSocket session."""
    return {"type": "conversation.item.input_audio_transcription.completed", "item_id": stream_id,
            "content_index": 0, "transcript": text, "audio_ms": int(round(seconds * 1000))}


def ws_speech_started(item_id: str, seconds: float) -> dict:
    """A turn began (turn detection): OpenAI's ``input_audio_buffer.speech_started``."""
    return {"type": "input_audio_buffer.speech_started", "item_id": item_id,
            "audio_start_ms": int(round(seconds * 1000))}


def ws_speech_stopped(item_id: str, seconds: float) -> dict:
    """A turn ended (turn detection): OpenAI's ``input_audio_buffer.speech_stopped``."""
    return {"type": "input_audio_buffer.speech_stopped", "item_id": item_id,
            "audio_end_ms": int(round(seconds * 1000))}


def ws_turn_completed(item_id: str, segment) -> dict:
    """One turn's transcript (turn detection): the completed event, with the turn's times."""
    return {"type": "conversation.item.input_audio_transcription.completed", "item_id": item_id, "content_index": 0,
            "transcript": segment.text, "audio_start_ms": int(round(segment.start * 1000)),
            "audio_end_ms": int(round(segment.end * 1000))}


def ws_suspended(stream_id: str, samples: int) -> dict:
    """Sent before the server closes a live session at shutdown (the stream is saved on disk)."""
    return {"type": "transcription_session.suspended", "session": {"id": stream_id, "samples_received": samples}}


def ws_error(code: str, message: str, server: bool = False) -> dict:
    """An error event (the session stays open unless the close that follows says otherwise); ``server``:
    the server's fault (``server_error``), not the request's."""
    kind = "server_error" if server else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "code": code, "message": message}}
