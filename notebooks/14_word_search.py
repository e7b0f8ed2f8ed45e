# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 14 · Words: a lexicon and a language model over the CTC log-probs
#
# The shipped model writes characters. Trained on open English text, a 2.9 M-parameter model spells
# tens of thousands of words by ear and gets many of them slightly wrong: `fone`, `becaus`,
# `beforedabasement`. A recognizer fixes that outside the network: a second beam search over the
# same log-probs in which a hypothesis may only spell words of a lexicon and each finished word is
# scored by a word language model (`oasr.ctc.words` states the rule; the twins are
# `oasr.reference.word_search` and `oasr.fast.word_search`).
#
# First a toy: five words, a bigram from six sentences, and log-probs made by hand.

# %%
import numpy as np
import torch

from oasr.ctc.words import WordLM
from oasr.fast.word_search import WordSearch as FastWordSearch
from oasr.reference.word_search import WordSearch
from oasr.tokenizers.char import CharTokenizer

torch.set_num_threads(1)
tok = CharTokenizer()
lm = WordLM.from_sentences(["the cat sat", "the cat ran", "a cat sat", "the dog ran", "the kit sat", "a dog sat"],
                           ["the", "a", "cat", "dog", "sat", "ran", "kit"], tok.alphabet)
print(len(lm.words), "words;", "log p(cat | the) =", round(lm.logp(lm.word_id("the"), lm.word_id("cat")), 3),
      "; log p(kit | the) =", round(lm.logp(lm.word_id("the"), lm.word_id("kit")), 3))
print("lookahead('ca') =", round(lm.lookahead["ca"], 3), "(the best unigram of a word starting with 'ca')")


# %% [markdown]
# The acoustic evidence: one frame per character, each a clear winner except the first letter of the
# second word, where `k` is a little likelier than `c`. Greedy CTC spells `the kat sat`: `kat` is not a
# word. The word search may spell only `cat`, `kit`, ...: it finds `the cat sat`.

# %%
def frames(spec):
    """log-probs: each entry is {char: prob}; the rest of the mass is spread over the other tokens."""
    out = np.full((len(spec), tok.vocab_size), np.log(1e-4))
    for t, probs in enumerate(spec):
        for ch, p in probs.items():
            out[t, 0 if ch == "<b>" else tok.symbols.index(ch)] = np.log(p)
    return torch.log_softmax(torch.tensor(out), -1)


spec = [{"t": 0.9}, {"h": 0.9}, {"e": 0.9}, {" ": 0.9}, {"k": 0.5, "c": 0.4}, {"a": 0.9}, {"t": 0.9},
        {" ": 0.9}, {"s": 0.9}, {"a": 0.9}, {"t": 0.9}, {"<b>": 0.9}]
lp = frames(spec)
greedy = tok.decode([int(i) for i in lp.argmax(-1) if int(i) != 0])
reference, fast = WordSearch(lm, tok.symbols), FastWordSearch(lm, tok.symbols)
states = [reference.new_state(), fast.new_state()]
reference.decode(states[:1], [lp])
fast.decode(states[1:], [lp])
answer = reference.finalize(states[0])
print("greedy:", repr(greedy), "  word search:", repr(answer.text))
print([(w.word, w.first_frame, w.last_frame) for w in answer.words])
assert greedy == "the kat sat" and answer.text == "the cat sat"
assert fast.finalize(states[1]) == answer and fast.snapshot(states[1]) == reference.snapshot(states[0])

# %% [markdown]
# ## The real thing
#
# The shipped model names its language model in its header: 200,000 sentences drawn from the recipe's
# own training-text generator (never a test sentence: the held-out split) and WordNet's everyday usage
# examples (shipped; the generator draws each word on its own, so only the examples teach word order),
# counted into a bigram over a 60,000-word lexicon. The recognizer builds it on first use (a few
# seconds) and runs the word search live, chunk by chunk, beside the engine's token search. Here are a
# few clips of the second test set (sentence forms and voices no recipe produces) decoded both ways.

# %%
from oasr.asr.metrics import error_rates
from oasr.asr.recognizer import Recognizer
from oasr.asr.testset import load_testset, shipped_testset_dir

clips = [c for c in load_testset(shipped_testset_dir("testset2")) if c.condition == "16k"][:12]
words = Recognizer(max_streams=12)
tokens = Recognizer(max_streams=12, language_model=None)
print(words.word_pass.spec, "|", words.word_pass.execution)
with_words = words.transcribe([c.path for c in clips])
without = tokens.transcribe([c.path for c in clips])
for c, a, b in list(zip(clips, without, with_words, strict=True))[:5]:
    print(f"ref:    {c.text}\ntokens: {a.text}\nwords:  {b.text}\n")
wer_tokens = error_rates([c.text for c in clips], [t.text for t in without])["wer"]
wer_words = error_rates([c.text for c in clips], [t.text for t in with_words])["wer"]
print(f"WER on these {len(clips)} clips: token search {100 * wer_tokens:.1f}%, word search {100 * wer_words:.1f}%")
assert wer_words < wer_tokens

# %% [markdown]
# The reference twin gives the same words. (`tests/test_word_pass.py` also suspends streams halfway and
# resumes them on the other twin: the search's state travels with the stream, exact floats, to the same words.)

# %%
ref_words = Recognizer(max_streams=12, twin="reference").transcribe([c.path for c in clips])
assert [t.text for t in ref_words] == [t.text for t in with_words]
print("reference twin: the same", len(clips), "transcripts")
