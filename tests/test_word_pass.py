"""The recognizer's word pass (``oasr.asr.word_pass``): the word search run live over the engine's chunks.

The oracle is the same search run once over the stream's whole log-probs (the engine keeps them with
``keep_log_probs``): the live pass, fed chunk by chunk, tick by tick, suspended and resumed, must give the
same words and frames."""

import json

import numpy as np
import pytest
import torch

from oasr.asr.audio import load_audio
from oasr.asr.language import LanguageSpec, recipe_lm, spec_from_info
from oasr.asr.recognizer import Recognizer
from oasr.asr.testset import load_testset
from oasr.ctc.words import WordSearchConfig
from oasr.reference.word_search import WordSearch
from tests.test_recognizer_sessions import PIECE, stream_clip

SPEC = LanguageSpec(sentences=20_000)  # a smaller text than the default: the same rule, built faster


@pytest.fixture(scope="module")
def clips():
    return [load_audio(item.path) for item in load_testset()[:4]]


@pytest.fixture(scope="module", params=["fast", "reference"])
def recognizer(request):
    torch.manual_seed(0)
    rec = Recognizer(max_streams=4, twin=request.param, language_model=SPEC)
    rec.engine.keep_log_probs = True  # the oracle's input
    return rec


def offline(rec, log_probs):
    search = WordSearch(rec.word_pass.search.lm, rec.tokenizer.symbols, rec.word_pass.search.config)
    state = search.new_state()
    search.decode([state], [log_probs])
    return search.finalize(state)


def test_the_live_pass_equals_one_search_over_the_whole_stream(recognizer, clips):
    rec = recognizer
    streams = [rec.open_stream() for _ in clips]
    done = {}
    for k in range(0, max(map(len, clips)), PIECE):
        for stream, pcm in zip(streams, clips, strict=True):
            if k < len(pcm):
                stream.accept(pcm[k : k + PIECE])
                if k + PIECE >= len(pcm):
                    stream.end()
        done.update((t.id, t) for t in rec.step())
    for _ in range(200):
        if len(done) == len(streams):
            break
        done.update((t.id, t) for t in rec.step())
    assert len(done) == len(streams)
    for stream in streams:
        want = offline(rec, rec.engine.result(stream.id).log_probs)
        transcript = done[stream.id]
        assert transcript.text == want.text
        fs = rec.word_pass.frame_seconds
        assert [(w.word, w.start, w.end) for w in transcript.words] == [
            (w.word, round(w.first_frame * fs, 3), round((w.last_frame + 1) * fs, 3)) for w in want.words]
        lexicon = rec.word_pass.search.lm.index
        assert all(word in lexicon for word in transcript.text.split())
    assert rec.pool_usage()["blocks_used"] == 0 and not rec.word_pass.states


def test_transcripts_are_lexicon_words_with_ordered_times(recognizer, clips):
    for t, pcm in zip(recognizer.transcribe(clips), clips, strict=True):
        assert t.text and t.text == " ".join(w.word for w in t.words)
        starts = [w.start for w in t.words]
        assert starts == sorted(starts) and all(0 <= w.start < w.end <= len(pcm) / 16000 + 0.1 for w in t.words)
        assert t.partials and t.partials[-1][1] == t.text


@pytest.mark.parametrize("suspend_at", [0, 4])
def test_suspend_and_resume_carry_the_word_search(recognizer, clips, suspend_at):
    pcm = clips[1]
    want = stream_clip(recognizer, pcm)
    assert stream_clip(recognizer, pcm, suspend_at=suspend_at) == want
    other = Recognizer(max_streams=2, twin="reference" if recognizer.twin == "fast" else "fast", language_model=SPEC)
    assert stream_clip(recognizer, pcm, suspend_at=suspend_at, target=other)[0] == want[0]
    assert stream_clip(recognizer, pcm, end_then_suspend=True, target=other)[0] == want[0]


def test_a_blob_goes_only_where_the_word_search_matches(recognizer, clips):
    plain = Recognizer(max_streams=2, language_model=None)
    stream = recognizer.open_stream()
    stream.accept(clips[0][: 4 * PIECE])
    recognizer.step()
    blob = recognizer.checkpoint(stream.id)
    with pytest.raises(ValueError, match="decoded with a word search"):
        plain.resume(blob)
    assert not plain.streams and plain.pool_usage()["blocks_used"] == 0
    recognizer.cancel(stream.id)
    assert stream.id not in recognizer.word_pass.states
    other = plain.open_stream()
    other.accept(clips[0][: 4 * PIECE])
    plain.step()
    with pytest.raises(ValueError, match="decoded without a word search"):
        recognizer.resume(plain.checkpoint(other.id))
    assert not recognizer.streams


def test_a_malformed_word_state_is_refused_before_anything_changes(recognizer, clips):
    from oasr.asr import recognizer as recognizer_module

    stream = recognizer.open_stream()
    stream.accept(clips[0][: 4 * PIECE])
    recognizer.step()
    blob = recognizer.suspend(stream.id)
    meta_at = len(recognizer_module.STREAM_MAGIC)
    (n,) = np.frombuffer(blob[meta_at : meta_at + 4], dtype="<u4")
    meta = json.loads(blob[meta_at + 4 : meta_at + 4 + n])
    assert meta["version"] == 3 and meta["words"]["version"] == 1
    meta["words"]["beams"][0][4] = "not a float"
    body = json.dumps(meta).encode()
    import hashlib
    import struct

    rest = blob[meta_at + 4 + n : -32]
    data = recognizer_module.STREAM_MAGIC + struct.pack("<I", len(body)) + body + rest
    data += hashlib.blake2b(data, digest_size=32).digest()
    with pytest.raises(ValueError, match="malformed word-search snapshot"):
        recognizer.resume(data)
    assert not recognizer.streams and recognizer.pool_usage()["blocks_used"] == 0
    recognizer.resume(blob)  # the good one still resumes
    recognizer.cancel(stream.id)


def test_turns_cut_the_word_search_with_the_engine(clips):
    from oasr.vad import EndpointConfig

    rec = Recognizer(max_streams=2, language_model=SPEC, endpointing=EndpointConfig())
    silence = np.zeros(int(2.0 * 16000), dtype=np.float32)
    pcm = np.concatenate([clips[0], silence, clips[1], silence])
    [alone_a, alone_b] = Recognizer(max_streams=2, language_model=SPEC).transcribe(clips[:2])
    [t] = rec.transcribe([pcm])
    assert len(t.segments) == 2
    assert [s.text for s in t.segments] == [alone_a.text, alone_b.text]
    assert t.text == f"{alone_a.text} {alone_b.text}"
    second = t.segments[1]
    assert all(second.start <= w.start < w.end <= second.end + 0.5 for w in second.words)
    assert [w.word for w in second.words] == alone_b.text.split()


def test_full_context_uses_the_word_search(clips):
    rec = Recognizer(max_streams=2, language_model=SPEC, full_context=True)
    [t] = rec.transcribe(clips[:1])
    assert t.text and all(w in rec.word_pass.search.lm.index for w in t.text.split()) and t.words


def test_language_model_arguments_are_checked():
    with pytest.raises(ValueError, match="language_model must be"):
        Recognizer(language_model="bigram")
    with pytest.raises(ValueError, match="two different second passes"):
        Recognizer(language_model=SPEC, rescore=True)
    with pytest.raises(ValueError, match="word_config needs a language model"):
        Recognizer(language_model=None, word_config=WordSearchConfig())
    with pytest.raises(ValueError, match="WordSearchConfig"):
        Recognizer(language_model=SPEC, word_config={"beam_size": 4})
    assert Recognizer(language_model=SPEC, rescore=False).engine.emit_log_probs
    rescoring = Recognizer(rescore=True)  # "auto": no word search where rescoring is asked for
    assert rescoring.word_pass is None and not rescoring.engine.emit_log_probs


def test_language_specs_are_checked_and_read_from_checkpoint_info():
    for bad in ({"seed": "1"}, {"open_share": 1.5}, {"sentences": 0}, {"sentences": True}, {"english_repeat": -1},
                {"english_repeat": True}, {"english_repeat": "3"}, {"english_repeat": 1001},
                {"held_out_english": 1}):
        with pytest.raises(ValueError, match="LanguageSpec"):
            LanguageSpec(**bad)
    assert spec_from_info({}) is None
    assert spec_from_info({"language_model": SPEC.to_info()}) == SPEC
    written_before = {k: v for k, v in SPEC.to_info().items() if k not in ("english_repeat", "held_out_english")}
    assert spec_from_info({"language_model": written_before}) == LanguageSpec(sentences=20_000, english_repeat=0,
                                                                              held_out_english=True)
    with pytest.raises(ValueError, match="recipe_text_bigram"):
        spec_from_info({"language_model": {"kind": "trigram"}})


def _sentence_logp(lm, text: str) -> float:
    ids = [lm.start_id, *(lm.index[w] for w in text.split()), lm.end_id]
    return sum(lm.logp(a, b) for a, b in zip(ids[:-1], ids[1:], strict=True))


def test_the_shipped_english_sentences_are_clean_and_steer_the_model():
    from oasr.asr.language import load_english, normalize_sentence
    from oasr.asr.testset import shipped_testset_dir
    from oasr.tokenizers.char import CharTokenizer

    english = load_english()
    assert len(english) > 40_000 and len(set(english)) == len(english)
    assert all(normalize_sentence(t) == t for t in english)  # what the tokenizer spells, 2-30 words
    tested = {c.text for c in [*load_testset(), *load_testset(shipped_testset_dir("testset2"))]}
    assert not tested & set(english)  # no sentence of a shipped test set is counted
    alphabet = CharTokenizer().alphabet
    with_english = recipe_lm(SPEC, alphabet)
    without = recipe_lm(LanguageSpec(sentences=20_000, english_repeat=0), alphabet)
    assert with_english.words == without.words  # the lexicon stays the recipe's
    hold, your = with_english.index["hold"], with_english.index["your"]  # "hold your breath" is an example
    assert with_english.logp(hold, your) > without.logp(hold, your) + 1.0
    from oasr.asr.text import is_held_out

    held = next(t for t in english if is_held_out(t) and len(t.split()) > 3  # an example only the voice dev speaks
                and all(w in with_english.index for w in t.split()))
    counted = recipe_lm(LanguageSpec(sentences=20_000, held_out_english=True), alphabet)
    assert _sentence_logp(counted, held) > _sentence_logp(with_english, held) + 3.0, held  # out unless asked for
    assert normalize_sentence("Don't tread on me!") == "don't tread on me"
    assert normalize_sentence("call 911") is None and normalize_sentence("hello") is None


def test_every_word_of_both_shipped_sets_is_in_the_recipe_lexicon():
    from oasr.asr.testset import shipped_testset_dir
    from oasr.tokenizers.char import CharTokenizer

    lm = recipe_lm(SPEC, CharTokenizer().alphabet)  # the sets use the vocabulary the recipe trains on
    for clip in [*load_testset(), *load_testset(shipped_testset_dir("testset2"))]:
        assert all(w in lm.index for w in clip.text.split()), clip.text


def test_a_bad_chunk_fails_its_own_stream_only(recognizer, clips):
    rec = recognizer
    good, bad = rec.open_stream(), rec.open_stream()
    for stream in (good, bad):
        stream.accept(clips[0][: 6 * PIECE])
    real_step = rec.engine.step

    def poisoned():
        outputs = real_step()
        if bad.id in outputs and outputs[bad.id].log_probs is not None:
            outputs[bad.id].log_probs = torch.full_like(outputs[bad.id].log_probs, float("nan"))
        return outputs

    rec.engine.step = poisoned
    failed = []
    try:
        for _ in range(4):
            rec.step(on_error=lambda sid, exc: failed.append((sid, str(exc))))
    finally:
        del rec.engine.step
    assert failed and {sid for sid, _ in failed} == {bad.id} and "NaN" in failed[0][1]
    assert good.text  # the other stream's words went on
    for stream in (good, bad):
        rec.cancel(stream.id)
