"""The recognizer's word pass: every stream's CTC log-probs through the word search, chunk by chunk.

``Recognizer(language_model=...)`` turns it on (``"auto"``: the language model the checkpoint names,
``oasr.asr.language``). The engine then hands each tick's log-probs out (``StreamingEngine.emit_log_probs``)
and ``WordPass.advance`` feeds the cohort's chunks to the twin's ``WordSearch`` (``oasr.ctc.words``) in one
call; a stream's live text is the search's best hypothesis, its final text and word times the search's
answer when it ends. The engine's token search still runs (its partial tokens are what the engine reports);
the recognizer's text comes from here.

Turns (``oasr.asr.turns``): at an endpoint the ending turn keeps the words that began before the cut and the
stream's search starts afresh for the next turn, as the engine's state does. Suspend and resume carry the
search's snapshot (exact floats), so a resumed stream continues to the same words.
"""

from __future__ import annotations

from oasr.asr.words import Word
from oasr.ctc.words import WordResult, WordSearchConfig


class WordPass:
    """Per-stream word-search states over one ``WordSearch`` (of the recognizer's twin)."""

    def __init__(self, spec, lm, symbols, config: WordSearchConfig | None, twin: str, frame_seconds: float):
        if twin == "reference":
            from oasr.reference.word_search import WordSearch
        else:
            from oasr.fast.word_search import WordSearch
        self.spec = spec  # the oasr.asr.language.LanguageSpec the model was built from
        self.search = WordSearch(lm, symbols, config)
        self.execution = getattr(self.search, "execution", "reference twin (Python)")
        self.frame_seconds = frame_seconds
        self.states: dict = {}

    def open(self, stream_id) -> None:
        """A new stream (or the next turn of one): a fresh search."""
        self.states[stream_id] = self.search.new_state()

    def drop(self, stream_id) -> None:
        """Forget a stream (cancelled, suspended, finished)."""
        self.states.pop(stream_id, None)

    def advance(self, outputs: dict) -> list:
        """Feed this tick's chunks (one search call for all); returns the ids whose best text may have changed."""
        ids = [sid for sid, out in outputs.items()
               if out.log_probs is not None and out.num_frames and sid in self.states]
        if ids:
            self.search.decode([self.states[sid] for sid in ids], [outputs[sid].log_probs for sid in ids])
        return ids

    def text(self, stream_id) -> str:
        """The stream's live text (the best hypothesis, its unfinished word shown)."""
        return self.search.best(self.states[stream_id]).text

    def finish(self, stream_id, offset_seconds: float) -> tuple[str, list]:
        """The stream's (or its last turn's) final text and words; the state is dropped."""
        result = self.search.finalize(self.states.pop(stream_id))
        return result.text, self._words(result, offset_seconds)

    def whole(self, log_probs) -> tuple[str, list]:
        """Text and words of one utterance's log-probs searched at once (full context: no stream is involved)."""
        state = self.search.new_state()
        self.search.decode([state], [log_probs])
        result = self.search.finalize(state)
        return result.text, self._words(result, 0.0)

    def cut(self, stream_id, cut_frame: int, offset_seconds: float) -> tuple[str, list]:
        """End a turn at encoder frame ``cut_frame`` (of the turn): the words that began before it, and a
        fresh search for the next turn."""
        result = self.search.finalize(self.states[stream_id])
        kept = tuple(w for w in result.words if w.first_frame < cut_frame)
        self.states[stream_id] = self.search.new_state()
        kept_result = WordResult(" ".join(w.word for w in kept), kept)
        return kept_result.text, self._words(kept_result, offset_seconds)

    def _words(self, result: WordResult, offset_seconds: float) -> list:
        fs = self.frame_seconds
        return [Word(w.word, round(offset_seconds + w.first_frame * fs, 3),
                     round(offset_seconds + (w.last_frame + 1) * fs, 3)) for w in result.words]

    def snapshot(self, stream_id) -> dict:
        """The stream's search as a JSON-able dict."""
        return self.search.snapshot(self.states[stream_id])

    def check(self, snapshot):
        """A state from a saved snapshot, checked, not yet installed (``ValueError`` for a bad one)."""
        return self.search.restore(snapshot)

    def install(self, stream_id, state) -> None:
        """Give a resumed stream its checked state."""
        self.states[stream_id] = state
