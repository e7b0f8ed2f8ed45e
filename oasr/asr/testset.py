"""The held-out test set shipped with the package: FLAC clips and their transcripts.

``make_testset(directory, count, seed)`` (recipe only, needs espeak-ng) speaks ``count`` held-out
sentences (``oasr.asr.text.is_held_out``: never in the training stream) with the held-out voice variants
(``oasr.asr.synth.TEST_VARIANTS``: never heard in training), perturbed like the training data, and writes
``NNNN.flac`` (16 kHz, 16-bit, mono) and ``transcripts.tsv``.
``load_testset()`` reads it back: the shipped copy under ``oasr/assets/testset`` by default.

``transcripts.tsv`` has one clip a line, ``id<TAB>text[<TAB>voice]``: the clip is ``<id>.flac`` beside
it (or ``<id>.wav`` / ``<id>.ogg`` / ``<id>.mp3``), ``text`` its reference transcript and the optional
``voice`` column either a plain voice name or a JSON object whose ``"voice"`` key names it (what
``make_testset`` writes: the object holds the other synthesis settings too). Any other line, or a listed
clip with no file, is refused with a ``ValueError`` naming the line.
It reads the second held-out set (``oasr.asr.testset2``, shipped under ``oasr/assets/testset2``) the same
way: there the JSON column also names each clip's ``condition`` (``16k`` when absent, as in the first set)
and, for a copy, its ``source`` clip.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from oasr.asr.text import SentenceGenerator


@dataclass(frozen=True)
class Clip:
    id: str
    path: Path
    text: str
    voice: str
    condition: str = "16k"
    source: str = ""  # a copy's base clip (same sentence and voice at 16 kHz), "" for a base clip

    @property
    def variant(self) -> str:
        """The espeak-ng voice variant (``en-us+m5`` -> ``m5``; ``none`` for clips without speech)."""
        return self.voice.split("+")[-1]


CLIP_EXTENSIONS = (".flac", ".wav", ".ogg", ".mp3")


def _description(column: str) -> dict:
    """A ``voice`` column as a dict: a plain name is ``{"voice": name}``; a JSON object is itself."""
    if column.startswith("{"):
        try:
            value = json.loads(column)
            if isinstance(value, dict):
                return value
        except json.JSONDecodeError:
            pass
    return {"voice": column}


def shipped_testset_dir(name: str = "testset") -> Path:
    """A held-out test set shipped inside the package: ``testset`` (the first) or ``testset2``."""
    if name not in ("testset", "testset2"):
        raise ValueError(f"shipped_testset_dir: 'testset' or 'testset2', got {name!r}")
    # from this file, not importlib.resources: right even when a clone named oasr was imported as the package
    return Path(__file__).resolve().parents[1] / "assets" / name


def make_testset(directory, count: int = 120, seed: int = 20261201) -> Path:
    """Synthesize ``count`` held-out clips (FLAC) and their ``transcripts.tsv`` into ``directory``, from ``seed``."""
    import soundfile as sf

    from oasr.asr.synth import TEST_VARIANTS, draw_utterance
    from oasr.features.fbank import SAMPLE_RATE

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    sentences = SentenceGenerator(seed, held_out=True)
    seen, rows = set(), []
    while len(rows) < count:
        text = next(sentences)
        if text in seen:
            continue
        seen.add(text)
        pcm, desc = draw_utterance(rng, text, TEST_VARIANTS)
        clip_id = f"{len(rows):04d}"
        sf.write(directory / f"{clip_id}.flac", pcm, SAMPLE_RATE, subtype="PCM_16", format="FLAC")
        rows.append(f"{clip_id}\t{text}\t{json.dumps(desc, sort_keys=True)}")
    (directory / "transcripts.tsv").write_text("\n".join(rows) + "\n")
    return directory


def load_testset(directory=None, limit: int | None = None) -> list[Clip]:
    """The clips of a test set directory (default: the shipped one), in id order."""
    directory = Path(directory) if directory is not None else shipped_testset_dir()
    table = directory / "transcripts.tsv"
    if not table.exists():
        raise ValueError(f"no test set at {directory} (transcripts.tsv missing)")
    clips = []
    for number, line in enumerate(table.read_text().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) not in (2, 3) or not fields[0]:  # an empty text is a clip with no speech
            raise ValueError(f"{table}:{number}: expected id<TAB>text[<TAB>voice], got {len(fields)} field(s)")
        clip_id, text = fields[0], fields[1]
        path = next((p for p in (directory / f"{clip_id}{ext}" for ext in CLIP_EXTENSIONS) if p.is_file()), None)
        if path is None:
            raise ValueError(f"{table}:{number}: clip {clip_id!r} is listed but {directory / (clip_id + '.flac')} "
                             "does not exist")
        desc = _description(fields[2] if len(fields) == 3 else "")
        clips.append(Clip(clip_id, path, text, str(desc.get("voice", "")), str(desc.get("condition", "16k")),
                          str(desc.get("source", ""))))
    return clips[:limit] if limit is not None else clips
