"""Reading audio for recognition: any format libsndfile reads (WAV, FLAC, OGG, MP3, ...), resampled to 16 kHz.

``load_audio(path, channel=None)`` returns mono float32 PCM in [-1, 1] at ``SAMPLE_RATE``;
``decode_audio(source, name)`` does the same for a path or a binary file object (an upload).
Several channels are averaged into one (a downmix) unless ``channel`` picks one of them
(0 is the first, the left of a stereo file). Every refusal is one ``AudioError`` (a ``ValueError``)
that says what was expected and what came:

* a file soundfile cannot decode (not audio, unknown container);
* a truncated WAV: its data chunk runs past the end of the file (a FLAC cut short fails to decode;
  any other file that holds fewer frames than libsndfile says its header declares is refused too,
  except MP3, whose length may be an estimate; other containers cut short are read as far as they go);
* an empty file, or one with no samples;
* a ``channel`` the file does not have;
* NaN or infinite samples (possible in float WAV files);
* a sample rate outside ``[MIN_RATE, MAX_RATE]``. Any rate inside it is resampled with soxr's
  high-quality filter; 16 kHz passes through untouched.

PCM already in memory goes through ``check_pcm``, which takes mono only: ``(N,)`` or ``(N, 1)``
(an ``(N, C)`` array is ambiguous with channels-first audio; mix it down yourself, e.g. ``pcm.mean(1)``).
"""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np

from oasr.features.fbank import SAMPLE_RATE

MIN_RATE, MAX_RATE = 8000, 192000
FORMATS = "WAV, FLAC, OGG, MP3 and the other formats libsndfile reads"


class AudioError(ValueError):
    """The input is not audio this recognizer can hear."""


def check_pcm(pcm, sample_rate: int, what: str = "audio") -> np.ndarray:
    """Validate and resample PCM already in memory: ``(N,)`` or ``(N, 1)`` float/int samples."""
    x = np.asarray(pcm)
    if x.ndim == 2 and x.shape[1] == 1:
        x = x[:, 0]
    if x.ndim != 1:
        channels = x.shape[1] if x.ndim == 2 else "?"
        raise AudioError(f"{what}: expected mono audio, got {channels} channels (shape {x.shape}); "
                         "mix it down first (e.g. pcm.mean(axis=1)) or pick a channel")
    if x.dtype.kind in "iu":
        x = x.astype(np.float32) / float(np.iinfo(x.dtype).max + 1)
    elif x.dtype.kind != "f":
        raise AudioError(f"{what}: expected float or integer samples, got dtype {x.dtype}")
    x = x.astype(np.float32, copy=False)
    if x.size == 0:
        raise AudioError(f"{what}: no samples")
    if not np.isfinite(x).all():
        raise AudioError(f"{what}: {int((~np.isfinite(x)).sum())} samples are NaN or infinite")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
        raise AudioError(f"{what}: the sample rate must be an int, got {sample_rate!r}")
    if not MIN_RATE <= sample_rate <= MAX_RATE:
        raise AudioError(f"{what}: sample rate {sample_rate} Hz is outside [{MIN_RATE}, {MAX_RATE}] Hz")
    if sample_rate != SAMPLE_RATE:
        import soxr

        x = soxr.resample(x, int(sample_rate), SAMPLE_RATE, quality="HQ").astype(np.float32)
    return x


STREAMED_SIZE = 0x7FFFF000  # a WAV size this large (data and RIFF both) is a streaming writer's placeholder


def wav_data_chunk(head: bytes):
    """``(offset of the data chunk's header, its declared size, the RIFF size)`` of a RIFF/WAVE file from its
    first bytes ``head``; ``None`` when it is no WAV or the data chunk is not within ``head``."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(head):
        chunk, length = struct.unpack_from("<4sI", head, pos)
        if chunk == b"data":
            return pos, length, struct.unpack_from("<I", head, 4)[0]
        pos += 8 + length + (length & 1)
    return None


def wav_streamed(head: bytes) -> bool:
    """Whether a WAV's data size is a streaming writer's placeholder (it could not seek back to fill it in):
    0, 0xFFFFFFFF, or 0x7FFFF000 and up with a RIFF size of that range too (``espeak-ng --stdout`` writes
    0x7FFFF000 and 0x7FFFF024). Such a file's data runs to its end."""
    return _placeholder(wav_data_chunk(head))


def _placeholder(found) -> bool:
    if found is None:
        return False
    _, length, riff = found
    return length in (0, 0xFFFFFFFF) or (length >= STREAMED_SIZE and riff >= STREAMED_SIZE)


def wav_truncation(head: bytes, size: int) -> int:
    """Bytes a RIFF/WAVE file of ``size`` bytes lacks, from its first bytes ``head`` (0: whole, not a WAV, or a
    streamed one: ``wav_streamed``)."""
    found = wav_data_chunk(head)
    if found is None or _placeholder(found):
        return 0
    pos, length, _ = found
    return max(0, pos + 8 + length - size)


def wav_with_sizes(data: bytes) -> bytes:
    """A streamed WAV's bytes with its RIFF and data sizes set to what the file holds (whole sample frames)."""
    pos, _, _ = wav_data_chunk(data)
    body = len(data) - (pos + 8)
    block = struct.unpack_from("<H", data, 32)[0] if len(data) >= 34 and data[12:16] == b"fmt " else 0
    if block > 1:
        body -= body % block
    out = bytearray(data[: pos + 8 + body])
    struct.pack_into("<I", out, 4, len(out) - 8)
    struct.pack_into("<I", out, pos + 4, body)
    return bytes(out)


def pick_channel(pcm: np.ndarray, channel, what: str) -> np.ndarray:
    """``(N, C)`` samples to ``(N,)``: their mean (``channel=None``), or channel ``channel`` (0-based)."""
    count = pcm.shape[1]
    if channel is None:
        return pcm[:, 0] if count == 1 else pcm.mean(axis=1, dtype=np.float32)
    if isinstance(channel, bool) or not isinstance(channel, (int, np.integer)) or not 0 <= channel < count:
        raise AudioError(f"{what}: channel {channel!r} does not exist: the file has {count} channel(s), "
                         f"0..{count - 1}")
    return pcm[:, channel]


def decode_audio(source, name: str, channel: int | None = None) -> np.ndarray:
    """Mono float32 PCM at 16 kHz from a path or a binary file object (``AudioError`` for anything else)."""
    import soundfile as sf

    if isinstance(source, (str, Path)):
        size = Path(source).stat().st_size
        with open(source, "rb") as f:
            head = f.read(1 << 16)
        source = str(source)
    else:
        start = source.tell()
        head = source.read(1 << 16)
        size = start + len(head) + len(source.read())
        source.seek(start)
    if size == 0:
        raise AudioError(f"{name}: the file is empty (0 bytes)")
    if wav_streamed(head):  # the data runs to the end: give the decoder the sizes the writer could not
        if isinstance(source, str):
            data = Path(source).read_bytes()
        else:
            data = source.read()
            source.seek(start)
        source, start = io.BytesIO(wav_with_sizes(data)), 0
    missing = wav_truncation(head, size)
    if missing:
        raise AudioError(f"{name}: truncated WAV: its data chunk runs {missing} bytes past the end of the file")
    try:
        info = sf.info(source)
        # an MP3 without a Xing header has only an estimate of its length: no truncation check from it
        declared = 0 if info.format == "MP3" else info.frames
        if not isinstance(source, str):
            source.seek(start)
        pcm, rate = sf.read(source, dtype="float32", always_2d=True)
    except Exception as exc:  # soundfile raises LibsndfileError / RuntimeError / TypeError by format
        why = str(exc).strip().rsplit(">: ", 1)[-1] or type(exc).__name__  # drop soundfile's "<BytesIO at 0x..>"
        raise AudioError(f"{name}: not a readable audio file ({FORMATS} expected; {why})") from None
    if 0 < len(pcm) < declared:
        raise AudioError(f"{name}: truncated: the header declares {declared} frames, the file holds {len(pcm)}")
    return check_pcm(pick_channel(pcm, channel, name), rate, name)


def load_audio(path, channel: int | None = None) -> np.ndarray:
    """Mono float32 PCM at 16 kHz from an audio file (``AudioError`` for anything else; see the module)."""
    path = Path(path)
    if path.is_dir():
        raise AudioError(f"{path}: a directory, not an audio file")
    if not path.is_file():
        raise AudioError(f"{path}: no such file")
    return decode_audio(path, str(path), channel)


def read_bytes(data: bytes, name: str = "upload", channel: int | None = None) -> np.ndarray:
    """``decode_audio`` of an in-memory file."""
    return decode_audio(io.BytesIO(data), name, channel)
