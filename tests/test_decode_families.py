"""The decode-family registry: capabilities checked once at construction, per-family options objects."""

from __future__ import annotations

import types

import pytest

from oasr.engine.decode_families import (
    CAPABILITIES,
    CtcBeamOptions,
    RnntGreedyOptions,
    get_decode_family,
    list_decode_families,
    resolve_decode_family,
)
from oasr.models.transducer import TransducerHead, TransducerSpec


def _transducer_model():
    spec = TransducerSpec(vocab_size=7, blank_id=6, encoder_dim=4, pred_hidden=3, pred_layers=1)
    return types.SimpleNamespace(transducer=TransducerHead(spec))


def test_families_and_aliases():
    assert list_decode_families() == ["ctc_greedy", "ctc_prefix_beam", "rnnt_greedy"]
    assert get_decode_family("beam") is get_decode_family("ctc_prefix_beam")
    assert get_decode_family("greedy").name == "ctc_greedy"
    assert set(CAPABILITIES) == set(list_decode_families())
    with pytest.raises(ValueError, match="unknown decode family 'tdt'; known: ctc_greedy, ctc_prefix_beam, rnnt"):
        get_decode_family("tdt")


def test_a_transducer_is_refused_by_ctc_and_a_ctc_model_by_rnnt_naming_what_is_missing():
    model = _transducer_model()
    family, options = resolve_decode_family("rnnt_greedy", model, {"max_symbols_per_step": 2})
    assert family.name == "rnnt_greedy" and options == RnntGreedyOptions(max_symbols_per_step=2)
    with pytest.raises(ValueError, match=r"cannot be decoded with 'ctc_prefix_beam': it lacks config.vocab_size"):
        resolve_decode_family("beam", model)
    ctc = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=30))
    assert resolve_decode_family("greedy", ctc)[0].name == "ctc_greedy"
    with pytest.raises(ValueError, match=r"lacks transducer.spec.blank_id \(the blank.*; transducer.joint \("):
        resolve_decode_family("rnnt_greedy", ctc)


def test_the_shipped_ctc_model_passes_its_family():
    from oasr.asr.checkpoint import default_model_path, load_checkpoint

    model = load_checkpoint(default_model_path())[0]  # the encoder the StreamingEngine serves
    assert get_decode_family("ctc_prefix_beam").missing(model) == []
    assert [c.path for c in get_decode_family("rnnt_greedy").missing(model)][:1] == ["transducer.spec.blank_id"]


def test_options_are_the_familys_own():
    fam = get_decode_family("ctc_prefix_beam")
    assert fam.options({"beam_size": 8}) == CtcBeamOptions(beam_size=8)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['max_symbols_per_step'\]; valid: \['beam_size', "):
        fam.options({"max_symbols_per_step": 3})
    with pytest.raises(ValueError, match="valid: none"):
        get_decode_family("greedy").options({"beam_size": 2})
    with pytest.raises(ValueError, match="max_symbols_per_step must be >= 1"):
        RnntGreedyOptions(max_symbols_per_step=0)
    with pytest.raises(ValueError, match="nbest <= beam_size"):
        CtcBeamOptions(beam_size=2, nbest=3)
