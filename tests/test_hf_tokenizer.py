"""``hf_json``: a checkpoint's tokenizer.json decodes token ids exactly as the checkpoint's processor does."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from oasr.tokenizers import build_tokenizer, list_tokenizers
from oasr.tokenizers.hf_json import HfJsonTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from nemotron_rnnt_oracle import SENTENCES, train_tokenizer  # noqa: E402

pytest.importorskip("transformers")


def _unigram():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=45, special_tokens=["<unk>"], unk_token="<unk>",
                                      show_progress=False)
    tok.train_from_iterator(SENTENCES + ["it's done , isn't it ?"], trainer)
    tok.add_special_tokens(["<blank>"])
    return tok


def _save_processor(path, tok, clean_up: bool):
    from transformers import NemotronAsrStreamingFeatureExtractor, NemotronAsrStreamingProcessor
    from transformers.models.parakeet.tokenization_parakeet import ParakeetTokenizer

    hf_tok = ParakeetTokenizer(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>",
                               clean_up_tokenization_spaces=clean_up)
    proc = NemotronAsrStreamingProcessor(NemotronAsrStreamingFeatureExtractor(), hf_tok)
    proc.save_pretrained(path)
    return proc


@pytest.mark.parametrize("kind,clean_up", [("bpe", False), ("bpe", True), ("unigram", True), ("unigram", False)])
def test_decode_equals_the_processor(tmp_path, kind, clean_up):
    from transformers import AutoProcessor

    _save_processor(tmp_path, train_tokenizer() if kind == "bpe" else _unigram(), clean_up)
    proc = AutoProcessor.from_pretrained(tmp_path)  # what a user of the saved checkpoint gets
    tok = build_tokenizer("hf_json", tmp_path)
    assert isinstance(tok, HfJsonTokenizer)
    assert tok.vocab_size == len(proc.tokenizer) and tok.blank_id == proc.blank_token_id == tok.vocab_size - 1
    rng = np.random.default_rng(1)
    cases = [[], [tok.blank_id], [0, 0, 3, 3, 3, tok.blank_id, 3]]
    cases += [rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 30))).tolist() for _ in range(200)]
    cases += [proc.tokenizer(s + " , it 's")["input_ids"] for s in SENTENCES]
    for ids in cases:
        assert tok.decode(ids) == proc.decode(ids, skip_special_tokens=True), ids
        assert tok.decode(ids, skip_special_tokens=False) == proc.decode(ids), ids
    assert [tok.decode(i) for i in cases[:20]] == proc.batch_decode(cases[:20], skip_special_tokens=True)


def test_refusals(tmp_path):
    assert {"char", "hf_json"} <= set(list_tokenizers())
    with pytest.raises(ValueError, match="unknown tokenizer kind 'spm'; known: char, hf_json"):
        build_tokenizer("spm")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_tokenizer("hf_json", tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a tokenizers file"):
        build_tokenizer("hf_json", tmp_path)
    train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "processor_config.json").write_text('{"blank_token": "<eps>"}')
    with pytest.raises(ValueError, match="the blank token '<eps>' is not in the vocabulary"):
        build_tokenizer("hf_json", tmp_path)
    tok = build_tokenizer("hf_json", tmp_path, blank_id=3)
    with pytest.raises(ValueError, match=r"ids \[99\] outside \[0, 41\)"):
        tok.decode([1, 99])
    assert build_tokenizer("char").decode([3, 1, 4]) == "a b"
