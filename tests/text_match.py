"""Comparing a segment's text with the same clip transcribed alone, as far as the model allows.

A turn or a file segment starts the clip at another place on the model's 40 ms frame grid than the clip
alone does (the gate keeps 50 ms of lead, the energy detector its own margin), and the model may then hear a
letter differently: the shipped model reads "the train eaves" for "the train leaves" in one shipped clip when
968 samples of silence come before it, and "leaves" with 800 or 1,600 (a property of the weights, not of the
turn logic). ``same_words`` keeps what the turn tests are for: every segment has as many words as its clip
alone (a turn that loses or repeats a word at its edge fails), and all of them together differ by at most
``letters`` character edits.
"""

from oasr.asr.metrics import edit_distance


def same_words(got: list, want: list, letters: int = 2) -> bool:
    """``got`` and ``want`` (lists of texts) match word for word in count, within ``letters`` edits in all."""
    if len(got) != len(want) or any(len(a.split()) != len(b.split()) for a, b in zip(got, want, strict=True)):
        return False
    return sum(edit_distance(list(a), list(b)) for a, b in zip(got, want, strict=True)) <= letters
