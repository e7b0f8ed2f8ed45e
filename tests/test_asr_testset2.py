"""The second shipped held-out set: what it holds, that the loader reads it, and the per-condition evaluation."""

import json
import shutil

import soundfile as sf

from oasr.asr.audio import load_audio
from oasr.asr.evaluation import breakdown
from oasr.asr.synth import ACCENTS, MORE_TRAIN_VARIANTS, TEST2_ACCENTS, TEST2_VARIANTS, TEST_VARIANTS, TRAIN_VARIANTS
from oasr.asr.testset import Clip, load_testset, shipped_testset_dir


def test_the_second_set_holds_every_condition_and_only_new_voices():
    clips = load_testset(shipped_testset_dir("testset2"))
    by = {}
    for c in clips:
        by.setdefault(c.condition, []).append(c)
        assert c.path.is_file()
    assert {k: len(v) for k, v in by.items()} == {"16k": 30, "8k": 15, "lead_silence": 6, "noise": 4, "long": 1,
                                                  "silence": 2, "noise_only": 2}
    assert set(TEST2_VARIANTS).isdisjoint(TRAIN_VARIANTS + MORE_TRAIN_VARIANTS + TEST_VARIANTS)
    assert "en-us-nyc" in TEST2_ACCENTS and "en-us-nyc" not in ACCENTS
    speech = [c for c in clips if c.text]
    assert all(c.variant in TEST2_VARIANTS for c in speech)
    assert {c.variant for c in speech} == set(TEST2_VARIANTS)
    assert all(not c.text and c.voice == "none" for c in by["silence"] + by["noise_only"])
    # 8 kHz clips are stored at 8 kHz and come back at 16 kHz; silences are digital zeros
    assert all(sf.info(str(c.path)).samplerate == 8000 for c in by["8k"])
    assert all(sf.info(str(c.path)).samplerate == 16000 for c in clips if c.condition != "8k")
    assert len(load_audio(by["8k"][0].path)) > 16000 and not load_audio(by["silence"][0].path).any()
    assert 55 < sf.info(str(by["long"][0].path)).duration < 70
    # both shipped sets together stay under 10 MB
    total = sum(p.stat().st_size for name in ("testset", "testset2") for p in shipped_testset_dir(name).iterdir())
    assert total <= 10_000_000, total


def test_copies_keep_their_source_sentence_and_voice():
    table = (shipped_testset_dir("testset2") / "transcripts.tsv").read_text().splitlines()
    rows = {line.split("\t")[0]: (line.split("\t")[1], json.loads(line.split("\t")[2])) for line in table}
    copies = [(text, d) for text, d in rows.values() if "source" in d]
    assert len(copies) == 25
    for text, d in copies:
        src_text, src = rows[d["source"]]
        assert src["condition"] == "16k" and src_text == text and src["voice"] == d["voice"]
    leads = [d["lead"] for _, d in copies if d["condition"] == "lead_silence"]
    assert all(1.0 <= s <= 3.0 for s in leads)


def test_breakdown_groups_and_no_speech_groups(tmp_path):
    clips = [Clip("a", tmp_path, "one two three", "en+m5", "16k"), Clip("b", tmp_path, "one two", "en+m5", "8k"),
             Clip("c", tmp_path, "", "none", "silence"), Clip("d", tmp_path, "", "none", "silence")]
    per = breakdown(clips, ["one two three", "one", "", "te ot"], lambda c: c.condition)
    assert per["16k"]["wer"] == 0.0 and per["8k"]["wer"] == 0.5
    assert per["silence"]["wer"] is None and per["silence"]["word_errors"] == 2 and per["silence"]["empty_hyps"] == 1
    voices = breakdown(clips, ["one two three", "one", "", ""], lambda c: c.variant)
    assert set(voices) == {"m5", "none"} and voices["none"]["empty_hyps"] == 2


def test_eval_reports_per_condition_and_per_voice(tmp_path, capsys):
    from oasr.__main__ import main as oasr_main

    src = shipped_testset_dir("testset2")
    table = (src / "transcripts.tsv").read_text().splitlines()
    keep = [line for line in table if line.split("\t")[0] in ("0000", "0030", "0056")]  # 16k, its 8k copy, silence
    for line in keep:
        shutil.copy(src / f"{line.split(chr(9))[0]}.flac", tmp_path)
    (tmp_path / "transcripts.tsv").write_text("\n".join(keep) + "\n")
    out = tmp_path / "r.json"
    assert oasr_main(["eval", "--testset", str(tmp_path), "--json", str(out), "--threads", "1"]) == 0
    r = json.loads(out.read_text())
    assert set(r["per_condition"]) == {"16k", "8k", "silence"} and r["per_condition"]["silence"]["wer"] is None
    assert r["per_condition"]["16k"]["utterances"] == 1 and "none" in r["per_voice"]
    assert set(r["paired"]) == {"8k"} and r["paired"]["8k"]["utterances"] == 1
    assert r["paired"]["8k"]["source_wer"] == r["per_condition"]["16k"]["wer"]
    printed = capsys.readouterr().out
    assert "per condition: 16k" in printed and "for the same 1 clips at 16 kHz" in printed
