"""RNN-T greedy decoding of Nemotron streaming checkpoints equals transformers' streaming generation.

Three tiny random checkpoints (``nemotron_rnnt_oracle.CONFIGS``: vary encoder and predictor sizes, LSTM
layers, ``max_symbols_per_step``, lookaheads), each with a small BPE tokenizer trained in the test and saved
with ``save_pretrained``; the joint is biased so that it emits tokens (see the oracle module). Audio: clips
of the shipped test set, one shorter than the first chunk. Features: oasr's ``nemo_mel`` streamed, cut into
chunks with the end-of-stream rule (0.0 frames up to the chunk boundary). The encoder is transformers' own
(its streaming caches carried across chunks) until oasr serves it; the decoder, the tokenizer and the
front end are oasr's. Token ids equal chunk by chunk, texts equal, in both twins.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.fast import rnnt_greedy as fast_rnnt
from oasr.features import NemoMel
from oasr.models.transducer import TransducerSpec, read_hf_transducer
from oasr.reference import rnnt_greedy as ref_rnnt
from oasr.tokenizers import build_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
import nemotron_rnnt_oracle as oracle  # noqa: E402
from nemotron_rnnt_oracle import HfEncoderStreams  # noqa: E402

pytest.importorskip("transformers")

TWINS = {"reference": ref_rnnt.decode_chunk, "fast": fast_rnnt.decode_chunk}
CLIPS = [(0, 1.6), (3, 0.9), (6, 0.1)]  # the last is shorter than any first chunk here


@pytest.fixture(scope="module", params=sorted(oracle.CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"nemotron_{request.param}")
    model, processor = oracle.make_checkpoint(path, request.param, seed=ord(request.param))
    return path, model, processor


def _features(path, pcm) -> torch.Tensor:
    mel = NemoMel.from_checkpoint(path)
    stream = mel.online()
    parts = [stream.accept(pcm[i : i + 1234]) for i in range(0, len(pcm), 1234)] + [stream.finish()]
    return torch.from_numpy(np.concatenate(parts))


def _zero_state(spec: TransducerSpec, batch: int) -> dict:
    return {s.name: torch.zeros(s.batch_shape(batch), dtype=s.dtype or torch.float32) for s in spec.state_specs()}


def _decode_stream(decode, head, enc_chunks):
    state, per_chunk = _zero_state(head.spec, 1), []
    for enc in enc_chunks:
        tokens, _, state = decode(head, enc[None], state)
        per_chunk.append(tokens[0])
    return per_chunk


def _by_chunk(tokens, where, num_chunks):
    out = [[] for _ in range(num_chunks)]
    for tok, c in zip(tokens, where, strict=True):
        out[c].append(tok)
    return out


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_tokens_and_text_equal_transformers_streaming(checkpoint, twin):
    path, model, processor = checkpoint
    head = read_hf_transducer(path)
    tok = build_tokenizer("hf_json", path)
    assert tok.blank_id == head.spec.blank_id == model.config.blank_token_id
    emitted = forced = 0
    for lookahead in processor.supported_num_lookahead_tokens[:2]:
        for index, seconds in CLIPS:
            feats = _features(path, oracle.clip(index, seconds))
            tokens, where, enc_chunks, sequence = oracle.oracle_stream(model, feats, lookahead)
            got = _decode_stream(TWINS[twin], head, enc_chunks)
            assert got == _by_chunk(tokens, where, len(enc_chunks)), (lookahead, index)
            text = tok.decode([t for chunk in got for t in chunk])
            assert text == processor.decode(sequence, skip_special_tokens=True)
            emitted += len(tokens)
            forced += sum(1 for c in got if len(c) >= head.spec.max_symbols_per_step)
    assert emitted > 20 and forced > 0  # the biased joint emits, and max_symbols_per_step is reached


def test_encoder_projection_equals_the_checkpoints(checkpoint):
    path, model, _ = checkpoint
    head = read_hf_transducer(path)
    x = torch.randn(3, 5, model.config.encoder_config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(head.project_encoder(x), model.encoder_projector(x), rtol=0, atol=0)
    assert set(head.state_dict()) == {k for k in model.state_dict() if not k.startswith("encoder.")}


def test_predictor_starts_from_blank_and_steps_as_the_checkpoints(checkpoint):
    """The zero slot state is the predictor fed blank from zero LSTM state; each step equals transformers'."""
    path, model, _ = checkpoint
    head = read_hf_transducer(path)
    spec = head.spec
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, spec.vocab_size - 1, (3, 6), generator=g)  # non-blank tokens
    state = _zero_state(spec, 3)
    with torch.no_grad():
        h, c, last = state["rnnt_h"], state["rnnt_c"], state["rnnt_last"][:, 0]
        ids = torch.full((3, 1), spec.blank_id)
        for i in range(seq.shape[1] + 1):
            want = model.decoder(ids)[:, -1]  # the whole history at once, no cache
            got, h, c = head.predict(last, h, c)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if i < seq.shape[1]:
                last = seq[:, i] + 1
                ids = torch.cat([ids, seq[:, i : i + 1]], dim=1)
        zero_token = head.predict(torch.ones(3, dtype=torch.int64), *(torch.zeros_like(x) for x in (h, c)))[0]
        assert not torch.allclose(zero_token, model.decoder(torch.full((3, 1), spec.blank_id))[:, -1])


def test_twins_agree_on_random_cohorts(checkpoint):
    """Random encoder outputs, random states, ragged frame counts: both twins give the same tokens and state."""
    path, _, _ = checkpoint
    head = read_hf_transducer(path)
    g = torch.Generator().manual_seed(3)
    for batch, frames in [(1, 1), (3, 4), (5, 2)]:
        enc = torch.randn(batch, frames, head.spec.encoder_dim, generator=g) * 2
        state = _zero_state(head.spec, batch)
        state["rnnt_h"].normal_(generator=g)
        state["rnnt_c"].normal_(generator=g)
        state["rnnt_last"].copy_(torch.randint(0, head.spec.vocab_size, (batch, 1), generator=g))
        lengths = torch.randint(0, frames + 1, (batch,), generator=g).tolist()
        before = {k: v.clone() for k, v in state.items()}
        want = ref_rnnt.decode_chunk(head, enc, state, lengths)
        got = fast_rnnt.decode_chunk(head, enc, state, lengths)
        assert got[0] == want[0] and got[1] == want[1]
        for name in state:
            torch.testing.assert_close(got[2][name], want[2][name], rtol=1e-6, atol=1e-6)
            assert torch.equal(state[name], before[name])  # the input state is never modified
        graphs = fast_rnnt.RnntGreedyGraphs(head)
        assert graphs.run(enc, state, lengths)[0] == want[0]
        # the fixed-count loop (what a CUDA graph runs) equals the CPU's early-exit loop
        fixed = {k: v.clone() for k, v in state.items()}
        with torch.no_grad():
            out = fast_rnnt._loop(head, head.project_encoder(enc), torch.tensor(lengths), fixed["rnnt_h"],
                                  fixed["rnnt_c"], fixed["rnnt_last"][:, 0], head.spec.max_symbols_per_step)
        assert fast_rnnt._unpack(*out) == (want[0], want[1])
        for name in state:
            torch.testing.assert_close(fixed[name], got[2][name], rtol=0, atol=0)


@pytest.mark.parametrize("twin", ["reference", "fast"])
def test_many_streams_in_one_cohort_equal_each_alone(checkpoint, twin):
    """Streams admitted at different chunks, batched in one slot cache, equal each stream decoded alone; a
    stream suspended mid-way (its slot state saved in a session) and resumed elsewhere gives the same tokens."""
    import importlib

    from oasr.cache.config import CacheConfig
    from oasr.sessions import stream as SS

    ops = importlib.import_module(f"oasr.{twin}")
    path, model, processor = checkpoint
    head = read_hf_transducer(path)
    lookahead = processor.supported_num_lookahead_tokens[0]
    streams = {}
    for s, (index, seconds) in enumerate([(1, 1.2), (2, 0.7), (4, 1.5), (5, 0.3)]):
        _, _, enc_chunks, _ = oracle.oracle_stream(model, _features(path, oracle.clip(index, seconds)), lookahead)
        streams[f"s{s}"] = (s, enc_chunks)  # stream s is admitted at tick s
    alone = {sid: _decode_stream(TWINS[twin], head, chunks) for sid, (_, chunks) in streams.items()}

    config = CacheConfig(num_layers=1, n_kv_head=1, head_dim=4, hidden_dim=4, kernel_size=3, chunk_size=2,
                         num_left_chunks=1, block_size_frames=2, max_num_blocks=8, max_batch_size=4,
                         max_blocks_per_seq=4)

    def stack():
        att = ops.AttentionCacheManager(ops.BlockPool(config, scratch_blocks=1), config, pad_lanes=1)
        return att, ops.SlotStateCache(head.spec.state_specs(), max_batch_size=4, pad_lanes=1)

    att, states = stack()
    got = {sid: [] for sid in streams}
    tick, session = 0, None
    while any(len(got[sid]) < len(chunks) for sid, (_, chunks) in streams.items()):
        if tick == 3:  # suspend s1: its slot state goes into a session and its slots are freed
            session, done_before = SS.save_stream("s1", att, [states]), len(got["s1"])
            att.free_stream("s1")
            states.free_stream("s1")
        if tick == 5:  # resume it (into whatever slot is free now), two ticks later
            SS.load_stream(session, "s1", att, [states])
        suspended = 3 <= tick < 5
        cohort = [sid for sid, (start, chunks) in streams.items()
                  if start <= tick and len(got[sid]) < len(chunks) and not (sid == "s1" and suspended)]
        for sid in cohort:
            if not states.has_stream(sid):
                att.allocate_stream(sid)
                states.allocate_stream(sid)
        if cohort:
            views = states.views(cohort)
            enc = torch.stack([streams[sid][1][len(got[sid])] for sid in cohort])
            tokens, _, new = TWINS[twin](head, enc, {k: v.gather() for k, v in views.items()})
            for k, v in views.items():
                v.scatter(new[k])
            for sid, toks in zip(cohort, tokens, strict=True):
                got[sid].append(toks)
        tick += 1
    assert session is not None and 0 < done_before < len(got["s1"])  # s1 was suspended mid-stream
    assert got == alone


def test_recognizer_audio_to_text_equals_transformers(checkpoint):
    """Audio pushed in pieces for several streams at once -> the same text (and chunk tokens) as transformers'
    streaming generation, at every trained lookahead; an untrained lookahead is refused in one line."""
    from oasr.asr.transducer import Lookaheads, TransducerRecognizer, transcribe_file

    path, model, processor = checkpoint
    lookaheads = Lookaheads.from_checkpoint(path)
    assert list(lookaheads.supported) == list(processor.supported_num_lookahead_tokens)
    for lookahead in processor.supported_num_lookahead_tokens:
        assert lookaheads.chunk_frames(lookahead) == (1 + 8 * lookahead, 8 * (lookahead + 1))
        rec = TransducerRecognizer(path, HfEncoderStreams.factory(model), lookahead, {"twin": "reference"}
                                   if lookahead % 2 else None, max_batch_size=4)
        clips = {sid: oracle.clip(index, seconds) for sid, (index, seconds) in enumerate(CLIPS)}
        for sid in clips:
            rec.add_stream(sid)
        pos = 0
        while pos < max(len(c) for c in clips.values()):
            for sid, pcm in clips.items():
                if pos < len(pcm):
                    rec.accept_audio(sid, pcm[pos : pos + 2345])
                    if pos + 2345 >= len(pcm):
                        rec.end_stream(sid)
            rec.step()
            pos += 2345
        rec.run()
        for sid, pcm in clips.items():
            tokens, where, enc_chunks, sequence = oracle.oracle_stream(model, _features(path, pcm), lookahead)
            assert rec.chunk_tokens(sid) == _by_chunk(tokens, where, len(enc_chunks))
            assert rec.text(sid) == processor.decode(sequence, skip_special_tokens=True)
    pcm = oracle.clip(7, 1.1)  # one clip, default lookahead, 4000-sample pieces
    *_, sequence = oracle.oracle_stream(model, _features(path, pcm), lookaheads.default)
    assert transcribe_file(path, pcm, HfEncoderStreams.factory(model)) == processor.decode(sequence,
                                                                                          skip_special_tokens=True)
    bad = max(lookaheads.supported) + 1
    with pytest.raises(ValueError, match=f"lookahead {bad} was not trained for this checkpoint; trained: "):
        TransducerRecognizer(path, HfEncoderStreams.factory(model), bad)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rnnt_decode_step_graph_replay_equals_eager_cuda():
    """On a GPU: the captured decode loop, replayed on new inputs of the same shape, equals the eager loop
    (tokens, frames, state) and the reference twin on the CPU."""
    from oasr.models.transducer import TransducerHead

    spec = TransducerSpec(vocab_size=33, blank_id=32, encoder_dim=24, pred_hidden=16, pred_layers=2,
                          max_symbols_per_step=3)
    torch.manual_seed(0)
    head = TransducerHead(spec).eval()
    with torch.no_grad():
        head.joint_net.head.bias[spec.blank_id] -= 1.0
    gpu = TransducerHead(spec).cuda().eval()
    gpu.load_state_dict(head.state_dict())
    graphs = fast_rnnt.RnntGreedyGraphs(gpu)
    # fp32 on both sides: cuDNN's RNN and convolutions default to TF32 on Ampere and later (an H200 gave
    # 1.4e-4 against the CPU with it on); the comparison with the CPU oracle is of fp32 arithmetic.
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        _replay_equals_eager_and_reference(spec, head, gpu, graphs)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert len(graphs._graphs) == 1


def _replay_equals_eager_and_reference(spec, head, gpu, graphs):
    for trial in range(3):  # the first call captures, the next replay
        g = torch.Generator().manual_seed(trial)
        enc = torch.randn(4, 5, spec.encoder_dim, generator=g) * 3
        state = _zero_state(spec, 4)
        state["rnnt_h"].normal_(generator=g)
        lengths = [5, 3, 0, 4]
        cuda_state = {k: v.cuda() for k, v in state.items()}
        replay = graphs.run(enc.cuda(), cuda_state, lengths)
        eager = fast_rnnt.decode_chunk(gpu, enc.cuda(), cuda_state, lengths)
        ref = ref_rnnt.decode_chunk(head, enc, state, lengths)
        assert replay[0] == eager[0] == ref[0] and replay[1] == eager[1]
        for name in state:
            assert torch.equal(replay[2][name], eager[2][name])
            torch.testing.assert_close(replay[2][name].cpu(), ref[2][name], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("twin", sorted(TWINS))
def test_end_to_end_with_oasrs_encoder_equals_transformers(checkpoint, twin):
    """Everything oasr's: front end, the Nemotron encoder over paged caches, the transducer, the tokenizer.
    Several streams in one engine, audio in pieces: each text equals transformers' streaming generation, at
    every trained lookahead, chunk tokens too."""
    from oasr.asr.transducer import TransducerRecognizer

    path, model, processor = checkpoint
    clips = {sid: oracle.clip(index, seconds) for sid, (index, seconds) in enumerate(CLIPS)}
    for lookahead in processor.supported_num_lookahead_tokens:
        rec = TransducerRecognizer(path, None, lookahead, {"twin": twin}, max_batch_size=4)
        for sid in clips:
            rec.add_stream(sid)
        for pos in range(0, max(len(c) for c in clips.values()), 3001):
            for sid, pcm in clips.items():
                if pos < len(pcm):
                    rec.accept_audio(sid, pcm[pos : pos + 3001])
                    if pos + 3001 >= len(pcm):
                        rec.end_stream(sid)
            rec.step()
        rec.run()
        for sid, pcm in clips.items():
            tokens, where, enc_chunks, sequence = oracle.oracle_stream(model, _features(path, pcm), lookahead)
            assert rec.chunk_tokens(sid) == _by_chunk(tokens, where, len(enc_chunks)), (lookahead, sid)
            assert rec.text(sid) == processor.decode(sequence, skip_special_tokens=True)


def test_full_size_transducer_decodes_a_chunk_on_the_cpu():
    """The published configuration's transducer (transformers' defaults: 1025 symbols, a 2-layer 640-wide
    predictor, encoder width 1024, 10 symbols per frame), random weights: a cohort's chunk in both twins."""
    from transformers import NemotronAsrStreamingConfig

    from oasr.models.transducer import TransducerHead

    spec = TransducerSpec.from_hf_config(NemotronAsrStreamingConfig().to_dict())
    assert (spec.vocab_size, spec.blank_id, spec.pred_hidden, spec.pred_layers, spec.encoder_dim,
            spec.max_symbols_per_step) == (1025, 1024, 640, 2, 1024, 10)
    torch.manual_seed(0)
    head = TransducerHead(spec).eval()
    enc = torch.randn(3, 4, spec.encoder_dim)
    state = _zero_state(spec, 3)
    want = ref_rnnt.decode_chunk(head, enc, state)
    got = fast_rnnt.decode_chunk(head, enc, state)
    assert got[0] == want[0] and all(len(t) <= 4 * 10 for t in got[0])


def test_recognizer_suspend_resume_elsewhere_gives_the_uninterrupted_text(checkpoint):
    """oasr's encoder: a stream suspended mid-clip (encoder caches, predictor slot state, front-end state, tokens)
    and resumed in another recognizer goes on to transformers' text; the other stream is unaffected."""
    from oasr.asr.transducer import TransducerRecognizer

    path, model, processor = checkpoint
    lookahead = processor.supported_num_lookahead_tokens[-1]
    clips = {"x": oracle.clip(8, 1.4), "y": oracle.clip(9, 1.0)}
    first = TransducerRecognizer(path, None, lookahead, max_batch_size=2)
    second = TransducerRecognizer(path, None, lookahead, {"twin": "reference"}, max_batch_size=2)
    for sid in clips:
        first.add_stream(sid)
    owner, data, pos = {"x": first, "y": first}, None, 0
    while pos < max(len(c) for c in clips.values()):
        for sid, pcm in clips.items():
            if pos < len(pcm):
                owner[sid].accept_audio(sid, pcm[pos : pos + 1999])
                if pos + 1999 >= len(pcm):
                    owner[sid].end_stream(sid)
        first.step()
        second.step()
        pos += 1999
        if pos == 3 * 1999:  # mid-clip, a few chunks in, and mid-chunk
            assert first.chunk_tokens("x")
            data = first.suspend("x")
            with pytest.raises(KeyError):
                first.text("x")
            second.resume(data, "x")
            owner["x"] = second
    first.run()
    second.run()
    assert data is not None
    for sid, pcm in clips.items():
        *_, sequence = oracle.oracle_stream(model, _features(path, pcm), lookahead)
        assert owner[sid].text(sid) == processor.decode(sequence, skip_special_tokens=True), sid
    with pytest.raises(ValueError, match="not a suspended stream"):
        second.resume(b"garbage", "z")


def test_fast_decode_loop_is_capture_safe_and_the_reference_is_not():
    """The fast twin's chunk loop does nothing a CUDA graph cannot capture (no host read, no data-dependent
    shape, no pageable upload), checked on the CPU op by op; the reference's per-stream loop is flagged."""
    from oasr.fast.capture_check import CaptureSafetyChecker
    from oasr.models.transducer import TransducerHead

    spec = TransducerSpec(vocab_size=17, blank_id=16, encoder_dim=8, pred_hidden=6, pred_layers=2,
                          max_symbols_per_step=3)
    torch.manual_seed(1)
    head = TransducerHead(spec).eval()
    enc = torch.randn(3, 4, spec.encoder_dim)
    state = _zero_state(spec, 3)
    lengths = torch.tensor([4, 2, 3])
    checker = CaptureSafetyChecker()
    checker.declare_device(head, enc, lengths, state)
    with checker.region("rnnt chunk") as record, torch.no_grad():
        fast_rnnt._loop(head, head.project_encoder(enc), lengths, state["rnnt_h"], state["rnnt_c"],
                        state["rnnt_last"][:, 0], spec.max_symbols_per_step)
    assert record.violations == [], record.summary()
    assert record.num_ops > 4 * 3 * 10  # the loop ran: frames x max_symbols iterations of several ops
    with checker.region("reference") as record:
        ref_rnnt.decode_chunk(head, enc, _zero_state(spec, 3), [4, 2, 3])
    assert record.violations


def test_end_to_end_on_the_emulated_kernels_equals_transformers(tmp_path, monkeypatch):
    """Audio to text with the fast twin's attention on the g++-emulated CUDA kernels (head_dim 64, a tile the
    kernels have; the relative-position term inside the kernel): the text and each chunk's tokens equal
    transformers' streaming generation, and no kernel gap was counted (the kernel, not torch, served every
    attention call)."""
    from oasr.asr.transducer import TransducerRecognizer
    from oasr.fast import backend, kernel_policy

    model, processor = oracle.make_checkpoint(tmp_path, "a", seed=11,
                                              overrides=dict(hidden_size=128, num_attention_heads=2,
                                                             num_hidden_layers=1, lookaheads=[1]))
    clips = {sid: oracle.clip(index, seconds) for sid, (index, seconds) in enumerate(CLIPS[:2])}
    monkeypatch.setenv(backend.ENV_VAR, "emulated")
    kernel_policy.reset_counts()
    rec = TransducerRecognizer(tmp_path, None, 1, {"twin": "fast"}, max_batch_size=2)
    for sid, pcm in clips.items():
        rec.add_stream(sid)
        rec.accept_audio(sid, pcm)
        rec.end_stream(sid)
    rec.run()
    assert backend.backends_used()["cpu"] == "emulated"
    assert kernel_policy.gaps["paged-attention-head-dim"] == 0
    monkeypatch.delenv(backend.ENV_VAR)
    for sid, pcm in clips.items():
        tokens, where, enc_chunks, sequence = oracle.oracle_stream(model, _features(tmp_path, pcm), 1)
        assert rec.chunk_tokens(sid) == _by_chunk(tokens, where, len(enc_chunks)), sid
        assert rec.text(sid) == processor.decode(sequence, skip_special_tokens=True)
    assert any(rec.text(sid) for sid in clips)  # the biased joint emits tokens: the comparison is not of blanks
