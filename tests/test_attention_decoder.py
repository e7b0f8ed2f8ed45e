"""The seeded attention decoder over the decoder cache: incremental == full, beam 1 == greedy,
paged == dense, fast == reference, in fp32 and fp8; decode attention under the emulated kernels."""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.ctc.config import CtcHypothesis
from oasr.decoder.kv import PagedDecoderKV
from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig, attention_rescore

TWINS = {"reference": reference, "fast": fast}


@pytest.fixture(scope="module")
def decoder():
    return AttentionDecoder(DecoderConfig(seed=3))


def encoder_outputs(lens=(7, 5), dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g) for n in lens]


def make_group(decoder, ops, storage, encs, max_new, kv_cache_dtype=None, backend=None):
    cfg = decoder.config.cache_config(kv_cache_dtype=kv_cache_dtype)
    if storage == "dense":
        return ops.DenseDecoderKV(cfg, len(encs), capacity=1 + max_new, cross_capacity=max(e.shape[0] for e in encs))
    kw = {} if backend is None or ops is reference else {"backend": backend}
    manager = ops.DecoderKVCacheManager(cfg, **kw)
    return PagedDecoderKV.admit(manager, [decoder.request(e.shape[0], max_new) for e in encs], ops, backend)


def fp8_round(ops):
    from oasr.reference import fp8  # (imported here: the attribute exists only once the module is loaded)

    q = fp8.quantize if ops is reference else fast.kv_formats.quantize_fp8

    def rnd(x):
        data, scale = q(x)
        return (data.float() * scale[..., None]).to(x.dtype)

    return rnd


@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@torch.no_grad()
def test_incremental_equals_full_forward(decoder, twin, storage, kv_cache_dtype):
    ops = TWINS[twin]
    encs = encoder_outputs((6, 6))
    steps = 7
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, decoder.config.vocab_size - 1, (2, steps + 2), generator=g)
    tokens[:, 0] = decoder.config.sos
    prompt_len = 2
    kv = make_group(decoder, ops, storage, encs, steps + prompt_len, kv_cache_dtype)
    decoder.fill_cross(kv, encs)
    got = [decoder.prefill(kv, tokens[:, :prompt_len])]
    for t in range(prompt_len, tokens.shape[1]):
        got.append(decoder.step(kv, tokens[:, t]))
    got = torch.stack(got, dim=1)  # logits at positions prompt_len-1 .. T-1
    enc = torch.stack(encs)
    rnd = fp8_round(ops) if kv_cache_dtype else None
    full = decoder.forward_full(tokens, enc, kv_round=rnd, fresh=prompt_len)[:, prompt_len - 1:]
    # Equal up to summation order, fp8 included: the oracle rounds K/V by the same per-vector rule (a
    # neighbouring-e4m3 flip would show as ~1e-2; the seeded case has none). fp8 itself moves the logits
    # by ~0.2 here, so the fp8 comparison is not vacuous.
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)
    if kv_cache_dtype:
        plain = decoder.forward_full(tokens, enc)[:, prompt_len - 1:]
        assert (plain - full).abs().max() > 1e-2


@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@torch.no_grad()
def test_beam_one_equals_greedy(decoder, twin, storage, kv_cache_dtype):
    ops = TWINS[twin]
    encs = encoder_outputs((7, 5), seed=4)
    kv = make_group(decoder, ops, storage, encs, 12, kv_cache_dtype)
    greedy = decoder.greedy(kv, encs, 12)
    for b, enc in enumerate(encs):
        one = make_group(decoder, ops, storage, [enc], 12, kv_cache_dtype)
        tokens, _ = decoder.beam_search(one, enc, beam=1, max_new_tokens=12)
        assert tokens == greedy[b]


@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@torch.no_grad()
def test_storage_and_twins_agree_token_for_token(decoder, kv_cache_dtype):
    encs = encoder_outputs((7, 5, 3), seed=9)
    results = {}
    for twin, ops in TWINS.items():
        for storage in ("dense", "paged"):
            kv = make_group(decoder, ops, storage, encs, 10, kv_cache_dtype)
            results[twin, storage] = decoder.greedy(kv, encs, 10)
    first = results["reference", "dense"]
    assert all(r == first for r in results.values()), results
    assert any(len(h) > 2 for h in first)  # the decode did something


@pytest.mark.parametrize("twin", list(TWINS))
@torch.no_grad()
def test_beam_search_on_dense_beams(decoder, twin):
    ops = TWINS[twin]
    enc = encoder_outputs((6,), seed=2)[0]
    dense = make_group(decoder, ops, "dense", [enc], 10)
    tokens, score = decoder.beam_search(dense, enc, beam=4, max_new_tokens=10)
    # the returned score is the decoder's own log-likelihood of the returned tokens (+ eos when it ended)
    (ll,) = decoder.score([tokens], enc)
    if len(tokens) < 10:
        assert abs(ll - score) < 1e-4
    greedy_tokens, _ = decoder.beam_search(make_group(decoder, ops, "dense", [enc], 10), enc, 1, 10)
    if len(greedy_tokens) < 10 and len(tokens) < 10:
        assert score >= decoder.score([greedy_tokens], enc)[0] - 1e-5  # beam 4 never finds worse than beam 1


@pytest.mark.parametrize("twin", list(TWINS))
@pytest.mark.parametrize("beam", [4, 8])
@pytest.mark.parametrize("seed", [2, 7])
@torch.no_grad()
def test_beam_search_on_copy_on_write_paged_beams_equals_dense(decoder, twin, beam, seed):
    """Paged beams fork onto shared pages (select with repeated parents); the search is the dense one,
    token for token and score for score (the oracle bit for bit; the fast twin reads the beams' shared
    cross region once, one grouped matmul for all of them, so its fp32 sums run in another order), and
    every page comes back when the beams finish."""
    ops = TWINS[twin]
    enc = encoder_outputs((6,), seed=seed)[0]
    want = decoder.beam_search(make_group(decoder, ops, "dense", [enc], 12), enc, beam=beam, max_new_tokens=12)
    paged = make_group(decoder, ops, "paged", [enc], 12)
    got = decoder.beam_search(paged, enc, beam=beam, max_new_tokens=12)
    assert got[0] == want[0]
    if twin == "reference":
        assert got[1] == want[1]
    else:
        assert abs(got[1] - want[1]) <= 1e-5 * max(1.0, abs(want[1]))
    manager = paged.manager
    counts = manager.pool.ref_counts()
    assert max(counts) > 1  # the final beams still share their prompt page and cross pages
    for row in manager.rows:
        manager.finish(row)
    assert manager.pool.num_free_blocks == manager.pool.num_blocks


def test_rescoring_picks_the_best_combined_score(decoder):
    enc = encoder_outputs((8,), seed=5)[0]
    nbest = [CtcHypothesis([3, 4], -1.0, [0, 1]), CtcHypothesis([3, 5, 6], -1.5, [0, 1, 2]),
             CtcHypothesis([], -4.0, [])]
    tokens, combined = attention_rescore(decoder, enc, nbest, ctc_weight=0.5)
    dec = decoder.score([list(h.tokens) for h in nbest], enc)
    assert combined == pytest.approx([d + 0.5 * h.log_score for d, h in zip(dec, nbest, strict=True)])
    assert tokens == list(nbest[max(range(3), key=lambda i: combined[i])].tokens)
    assert attention_rescore(decoder, enc, []) == ([], [])


@torch.no_grad()
def test_decode_attention_under_emulated_kernels():
    """The paged chunk kernel serves decode (one query per row, GQA rows packed) and the cross read
    (queries packed as heads), under the host SIMT emulation, fp32 and fp8, against the reference."""
    from oasr.fast.kernels import emulation

    try:  # the toolchain, as every emulated test checks it (the executor itself builds nothing until a launch)
        emulation.emulation_toolchain()
    except emulation.EmulationUnavailable as exc:  # CI requires it (OASR_REQUIRE_KERNELS=1)
        pytest.skip(f"kernel emulation unavailable: {exc}")
    dec = AttentionDecoder(DecoderConfig(head_dim=64, n_head=4, n_kv_head=2, seed=1))
    encs = encoder_outputs((9, 4), seed=7)
    for kv_cache_dtype in (None, "fp8_e4m3"):
        ref = make_group(dec, reference, "paged", encs, 6, kv_cache_dtype)
        emu = make_group(dec, fast, "paged", encs, 6, kv_cache_dtype, backend="emulated")
        dec.fill_cross(ref, encs)
        dec.fill_cross(emu, encs)
        sos = torch.full((2, 1), dec.config.sos, dtype=torch.long)
        a, b = dec.prefill(ref, sos), dec.prefill(emu, sos)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for _ in range(4):
            tok = a.argmax(-1)
            a, b = dec.step(ref, tok), dec.step(emu, tok)
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for r_row, e_row in zip(ref.rows, emu.rows, strict=True):
            want, got = ref.manager.gather_self(r_row), emu.manager.gather_self(e_row)
            assert torch.equal(want[0, :, :1], got[0, :, :1])  # layer 0's prompt K/V: the same computation
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # later ones ride on attention outputs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@torch.no_grad()
def test_decode_on_cuda_kernels_equals_reference(kv_cache_dtype, dtype):
    """The fast twin on a GPU (NVRTC kernels: batched append, decode attention, packed cross read) against
    the reference twin on the same device, token for token; logits within the dtype's rounding."""
    dev = torch.device("cuda", torch.cuda.current_device())
    dec = AttentionDecoder(DecoderConfig(head_dim=64, n_head=8, n_kv_head=2, seed=1)).to(dev, dtype)
    encs = [e.to(dev, dtype) for e in encoder_outputs((40, 17), seed=7)]
    cfg = dec.config.cache_config(kv_cache_dtype=kv_cache_dtype, device=dev, dtype=dtype)
    groups = []
    for ops in (reference, fast):
        manager = ops.DecoderKVCacheManager(cfg)
        groups.append(PagedDecoderKV.admit(manager, [dec.request(e.shape[0], 12) for e in encs], ops))
    for g in groups:
        dec.fill_cross(g, encs)
    sos = torch.full((2, 1), dec.config.sos, dtype=torch.long, device=dev)
    a, b = dec.prefill(groups[0], sos), dec.prefill(groups[1], sos)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for _ in range(10):
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)
        tok = a.argmax(-1)
        a, b = dec.step(groups[0], tok), dec.step(groups[1], tok)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("beam", [4, 8])
@torch.no_grad()
def test_paged_beams_on_cuda_equal_dense_beams(beam):
    """On a GPU the fast twin's paged beams (the prompt's and the beams' shared cross read staged through
    the pool, ``read_cross``; the decode kernels) find the dense beams' hypothesis, and every page returns."""
    dev = torch.device("cuda", torch.cuda.current_device())
    dec = AttentionDecoder(DecoderConfig(head_dim=64, n_head=8, n_kv_head=2, seed=1)).to(dev)
    enc = encoder_outputs((40,), seed=3)[0].to(dev)
    cfg = dec.config.cache_config(max_rows=beam, max_self_tokens=13, max_cross_tokens=40, device=dev)
    manager = fast.DecoderKVCacheManager(cfg)
    got = dec.beam_search(PagedDecoderKV.admit(manager, [dec.request(40, 12)], fast), enc, beam, 12)
    want = dec.beam_search(fast.DenseDecoderKV(cfg, 1, capacity=13, cross_capacity=40), enc, beam, 12)
    assert got[0] == want[0] and abs(got[1] - want[1]) <= 1e-4 * max(1.0, abs(want[1]))
    for r in manager.rows:
        manager.finish(r)
    assert manager.pool.num_used_blocks == 0


@pytest.mark.parametrize("twin", list(TWINS))
@torch.no_grad()
def test_score_shared_equals_score_and_computes_only_what_the_nbest_do_not_share(decoder, twin):
    ops = TWINS[twin]
    enc = encoder_outputs((8,), seed=5)[0]
    head = [3, 4, 5, 6, 7, 8, 9]  # with sos: 8 tokens, two full pages of 4
    hyps = [head + [10], head + [11, 12], head + [13], [3, 4]]
    manager = ops.DecoderKVCacheManager(decoder.config.cache_config())
    got, computed = decoder.score_shared(hyps, enc, manager, ops, scope="utt-0")
    want = decoder.score(hyps, enc)
    assert got == pytest.approx(want, abs=1e-4)
    # the first hypothesis computes 9 tokens; the next two reuse sos + 7 head tokens (8, two pages)
    assert computed == 9 + (10 - 8) + (9 - 8) + 3
    with pytest.raises(ValueError, match="give each call \\(utterance\\) its own scope"):
        decoder.score_shared(hyps, enc, manager, ops, scope="utt-0")
    assert manager.rows == []


def test_rescoring_through_the_shared_cache_picks_the_same_hypothesis(decoder):
    enc = encoder_outputs((8,), seed=5)[0]
    nbest = [CtcHypothesis([3, 4, 5, 6, 7], -1.0, [0, 1, 2, 3, 4]),
             CtcHypothesis([3, 4, 5, 6, 8], -1.2, [0, 1, 2, 3, 4]), CtcHypothesis([3, 4], -4.0, [0, 1])]
    plain = attention_rescore(decoder, enc, nbest)
    manager = fast.DecoderKVCacheManager(decoder.config.cache_config())
    shared = attention_rescore(decoder, enc, nbest, cache=(manager, fast, "utt"))
    assert shared[0] == plain[0] and shared[1] == pytest.approx(plain[1], abs=1e-4)
