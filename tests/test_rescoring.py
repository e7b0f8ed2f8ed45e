"""StreamingEngine(rescore=True): the U2/WeNet second pass over the streaming CTC n-best, both twins."""

import pytest
import torch

from oasr.engine import StreamingEngine, decode_utterance
from oasr.models import ConformerConfig, StreamingConformer
from oasr.models.attention_decoder import attention_rescore
from tests.test_engine import drive, features


def offline_hidden(model, feats):
    """The encoder output of one offline pass (the CTC head's input)."""
    seen = []
    handle = model.ctc.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    try:
        with torch.no_grad():
            log_probs = model.forward_offline(feats[None])[0][0]
    finally:
        handle.remove()
    return seen[-1][0], log_probs


def test_rescored_tokens_equal_the_offline_second_pass(twin):
    model = StreamingConformer(ConformerConfig(chunk_size=4, seed=3))
    cfg = model.config.cache_config(block_size_frames=3, max_batch_size=4)
    engine = StreamingEngine(model, cfg, twin=twin, rescore=True, ctc_weight=0.3)
    feats = {sid: features(60 + 17 * sid, seed=sid) for sid in range(3)}
    drive(engine, feats, {0: 0, 1: 1, 2: 3})
    for sid, f in feats.items():
        r = engine.result(sid)
        hidden, log_probs = offline_hidden(model, f)
        assert r.first_pass == decode_utterance(log_probs, "beam", engine.ctc_config)
        want, _ = attention_rescore(engine.rescorer, hidden, r.nbest, 0.3)
        assert r.tokens == want
    assert all(len(engine.result(sid).nbest) == 4 for sid in feats)  # the n-best list is really rescored


def test_rescore_needs_beam_search():
    model = StreamingConformer(ConformerConfig(chunk_size=4, seed=3))
    with pytest.raises(ValueError, match="rescore=True rescores the CTC n-best; it needs decoder='beam'"):
        StreamingEngine(model, model.config.cache_config(), decoder="greedy", rescore=True)
