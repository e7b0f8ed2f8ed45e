"""``FastDecodeStep``: decoder steps over paged K/V on per-width static buffers, eager or graphed.

Checked on the CPU: padded views agree between the twins; a step equals the
ordinary paged group's step (and the reference twin's) on a NaN-poisoned pool;
the step passes ``CaptureSafetyChecker`` with launch parameters fixed per
width; with the stand-in capture of tests/test_graph_runner.py (a replay may
read only what the capture read) replays equal eager steps bit for bit. The
``cuda`` test replays real CUDA graphs against eager steps (skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from oasr import fast, reference
from oasr.decoder.config import DecoderRequest
from oasr.decoder.kv import PagedDecoderKV
from oasr.engine.decode_step import FastDecodeStep
from oasr.fast.capture_check import CaptureSafetyChecker
from oasr.models.attention_decoder import AttentionDecoder, DecoderConfig
from tests.test_graph_runner import StandInCapture

TWINS = {"reference": reference, "fast": fast}


def make(kv_cache_dtype=None, max_rows=8, head_dim=16, device="cpu", graph_captured=False, kv_storage="paged",
         seed=3):
    decoder = AttentionDecoder(DecoderConfig(seed=seed, head_dim=head_dim)).to(device)
    cfg = decoder.config.cache_config(max_rows=max_rows, max_self_tokens=12, max_cross_tokens=9,
                                      kv_cache_dtype=kv_cache_dtype, device=device, graph_captured=graph_captured,
                                      kv_storage=kv_storage)
    return decoder, cfg


def poison(manager):
    """NaN in every pool slot (free blocks and the scratch block): only what a row wrote may be read."""
    pool = manager.pool
    for t in (pool.k_pool, pool.v_pool):
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.fill_(float("nan"))
        else:  # fp8 data: poison the scales instead
            pass
    for t in (pool.k_scale, pool.v_scale):
        if t is not None:
            t.fill_(float("nan"))


def admit_rows(decoder, manager, ops, lens=(7, 5, 9), seed=0):
    """Rows with cross K/V filled and a one-token prompt (sos) prefilled; returns the group."""
    g = torch.Generator().manual_seed(seed)
    encs = [torch.randn(n, decoder.config.encoder_dim, generator=g).to(manager.config.device) for n in lens]
    group = PagedDecoderKV.admit(manager, [decoder.request(e.shape[0], 10) for e in encs], ops)
    with torch.no_grad():
        decoder.fill_cross(group, encs)
        decoder.prefill(group, torch.full((len(encs), 1), decoder.config.sos, device=manager.config.device))
    return group


def tokens_for(step: int, rows: int) -> list[int]:
    return [(7 * step + 3 * r) % 31 for r in range(rows)]


# ---- the padded views -------------------------------------------------------------------------
def _numbers(views):
    return [(v.block_table.tolist(), v.cache_seqlens.tolist(), v.cache_seqstarts.tolist(), v.max_seqlen,
             v.max_span, v.prepared_frames) for v in views]


def test_padded_views_agree_between_twins_and_refuse_bad_widths():
    decoder, cfg = make()
    got = {}
    for name, ops in TWINS.items():
        manager = ops.DecoderKVCacheManager(cfg)
        group = admit_rows(decoder, manager, ops)
        rows = group.rows
        manager.prepare_step(rows)
        got[name] = (_numbers(manager.self_caches(rows[::-1], pad_to=4)),
                     _numbers(manager.cross_caches(rows, pad_to=8)), manager.cross_query_lens(rows, pad_to=5),
                     _numbers(manager.self_caches([], pad_to=2)))
        for bad, err in ((2, "pad_to=2 is smaller than the 3 rows"), (True, "pad_to must be ints")):
            with pytest.raises(ValueError, match=err):
                manager.self_caches(rows, pad_to=bad)
            with pytest.raises(ValueError, match=err):
                manager.cross_caches(rows, pad_to=bad)
    assert got["reference"] == got["fast"]
    self_views, _, lens, empty = got["fast"]
    null = fast.DecoderKVCacheManager(cfg).pool.null_block
    assert self_views[0][0][3] == [null] * cfg.self_pages and self_views[0][1][3] == 0  # the padding lane
    assert lens == [1, 1, 1, 0, 0] and empty[0][5] == (1, 1)


def test_fast_padded_views_are_static_per_width():
    decoder, cfg = make()
    manager = fast.DecoderKVCacheManager(cfg)
    rows = admit_rows(decoder, manager, fast).rows
    first = manager.self_caches(rows, pad_to=4)[0]
    manager.prepare_step(rows)
    again = manager.self_caches(rows[:1], pad_to=4)[0]
    assert again.block_table.data_ptr() == first.block_table.data_ptr()
    assert again.cache_seqlens.data_ptr() == first.cache_seqlens.data_ptr()
    assert manager.self_caches(rows, pad_to=8)[0].block_table.data_ptr() != first.block_table.data_ptr()


# ---- steps equal the ordinary paged step ------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
@pytest.mark.parametrize("staged", [False, True])
def test_decode_steps_equal_the_paged_group_and_the_reference(kv_cache_dtype, staged):
    """Three rows stepped through ``FastDecodeStep`` (width 4: one padding row on a poisoned scratch
    block), then one row finishing and two stepping (width 2): logits equal the ordinary paged group's
    step of the fast twin and of the reference twin, and so do the pages the rows wrote."""
    decoder, cfg = make(kv_cache_dtype)
    managers = {name: ops.DecoderKVCacheManager(cfg) for name, ops in TWINS.items()}
    managers["step"] = fast.DecoderKVCacheManager(cfg)
    for m in managers.values():
        poison(m)
    if staged:
        managers["step"]._stage_like_cuda()
    groups = {name: admit_rows(decoder, m, fast if name == "step" else TWINS[name]) for name, m in managers.items()}
    stepper = FastDecodeStep(decoder, managers["step"])
    for n in range(5):
        if n == 3:  # the middle row finishes: the next steps run at width 2
            groups = {name: g.select([0, 2]) for name, g in groups.items()}
        tokens = tokens_for(n, len(groups["step"].rows))
        got = stepper.run(groups["step"].rows, tokens)
        with torch.no_grad():
            want = {name: decoder.step(groups[name], torch.tensor(tokens)) for name in TWINS}
        assert not got.isnan().any()
        for name in TWINS:
            torch.testing.assert_close(got, want[name], rtol=1e-5, atol=1e-5)
    for r_step, r_ref in zip(groups["step"].rows, groups["reference"].rows, strict=True):
        assert managers["step"].length(r_step) == managers["reference"].length(r_ref) == 6
        torch.testing.assert_close(managers["step"].gather_self(r_step), managers["reference"].gather_self(r_ref),
                                   rtol=1e-5, atol=1e-5)


def test_run_refuses_bad_calls_before_changing_anything():
    decoder, cfg = make(max_rows=4)
    manager = fast.DecoderKVCacheManager(cfg)
    rows = admit_rows(decoder, manager, fast).rows
    stepper = FastDecodeStep(decoder, manager)
    before = [manager.describe(r) for r in rows]
    with pytest.raises(ValueError, match="2 tokens for 3 rows"):
        stepper.run(rows, [1, 2])
    with pytest.raises(KeyError, match="not admitted"):
        stepper.run([rows[0], 3], [1, 2])
    with pytest.raises(ValueError, match="5 rows exceed max_rows=4"):
        stepper.width_for(5)
    assert [manager.describe(r) for r in rows] == before


def test_graphs_need_paged_storage_and_auto_resolves_by_the_flag():
    decoder, cfg = make(kv_storage="auto", graph_captured=False)
    assert cfg.storage == "dense"
    with pytest.raises(ValueError, match="resolves kv_storage='auto' to 'dense'"):
        FastDecodeStep(decoder, fast.DecoderKVCacheManager(cfg), graphs=True, capture=StandInCapture())
    decoder, cfg = make(kv_storage="auto", graph_captured=True)
    assert cfg.storage == "paged"
    assert FastDecodeStep(decoder, fast.DecoderKVCacheManager(cfg), graphs=True, capture=StandInCapture()).graphed
    with pytest.raises(ValueError, match="fast twin's DecoderKVCacheManager"):
        FastDecodeStep(decoder, reference.DecoderKVCacheManager(cfg))


# ---- capture safety ---------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_decode_step_is_capture_safe(kv_cache_dtype):
    """Every step (host bookkeeping, uploads, gathers and the model's step) passes the checker on the
    staged path a CUDA device runs; launch parameters are the same at every step of one width."""
    decoder, cfg = make(kv_cache_dtype)
    manager = fast.DecoderKVCacheManager(cfg)
    manager._stage_like_cuda()
    rows = admit_rows(decoder, manager, fast, lens=(7, 5, 9, 4, 6)).rows
    stepper = FastDecodeStep(decoder, manager)
    checker = CaptureSafetyChecker()
    checker.declare_device(decoder, manager, stepper)
    keys = {}
    for n in range(6):
        cohort = rows if n % 2 else rows[:2]  # widths 8 and 2, alternating
        with checker.region(f"step {n}") as record:
            stepper.run(cohort, tokens_for(n, len(cohort)))
        assert record.violations == [], record.summary()
        assert record.pinned_uploads >= 2  # the meta, and the stale rows of the tables
        keys.setdefault(stepper.width_for(len(cohort)), []).append(record.launch_keys)
    for width, per_step in keys.items():
        assert len(per_step) == 3 and all(k == per_step[0] for k in per_step), width
        assert len(per_step[0]) == 3 * cfg.num_layers  # append, self and cross attention per layer


def test_the_ordinary_paged_step_is_not_capture_safe():
    """The check can fail: the eager group's step builds its positions and cross lengths from Python data."""
    decoder, cfg = make()
    manager = fast.DecoderKVCacheManager(cfg)
    manager._stage_like_cuda()
    group = admit_rows(decoder, manager, fast)
    checker = CaptureSafetyChecker()
    checker.declare_device(decoder, manager)
    with checker.region("eager group step") as record, torch.no_grad():
        decoder.step(group, torch.zeros(3, dtype=torch.long))
    assert any("Python data" in v for v in record.violations)


# ---- graphs: the stand-in capture on the CPU ----------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_graphed_steps_with_stand_in_equal_eager_bit_for_bit(kv_cache_dtype):
    decoder, cfg = make(kv_cache_dtype)
    capture = StandInCapture()
    managers = [fast.DecoderKVCacheManager(cfg) for _ in range(2)]
    for m in managers:
        poison(m)
    graphed = FastDecodeStep(decoder, managers[0], graphs=True, capture=capture)
    eager = FastDecodeStep(decoder, managers[1])
    assert graphed.runner.stats.widths == (8, 4, 2, 1) and capture.warmups == 2 * 4
    assert managers[0].pool.num_used_blocks == 0  # capture ran every row on the padding lane
    static = {w: [t.data_ptr() for t in graphed.static_buffers(w)] for w in graphed.widths}
    rows = [admit_rows(decoder, m, fast, lens=(7, 5, 9, 3, 8)).rows for m in managers]
    for n in range(6):
        take = [5, 1, 3, 5, 2, 4][n]
        got = graphed.run(rows[0][:take], tokens_for(n, take))
        want = eager.run(rows[1][:take], tokens_for(n, take))
        assert torch.equal(got, want), n
    assert capture.replays == 6
    assert static == {w: [t.data_ptr() for t in graphed.static_buffers(w)] for w in graphed.widths}
    for a, b in zip(rows[0], rows[1], strict=True):
        assert torch.equal(managers[0].gather_self(a), managers[1].gather_self(b))


# ---- a real GPU ---------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv_cache_dtype", [None, "fp8_e4m3"])
def test_cuda_graph_replay_equals_eager(kv_cache_dtype):
    """CUDA graphs of the decode step (head_dim 64: a kernel tile) replay to exactly the eager steps."""
    decoder, cfg = make(kv_cache_dtype, head_dim=64, device="cuda", graph_captured=True, kv_storage="auto")
    managers = [fast.DecoderKVCacheManager(cfg) for _ in range(2)]
    graphed = FastDecodeStep(decoder, managers[0], graphs=True)
    eager = FastDecodeStep(decoder, managers[1])
    assert graphed.graphed and graphed.runner.stats.num_graphs == 4
    rows = [admit_rows(decoder, m, fast, lens=(7, 5, 9, 3, 8)).rows for m in managers]
    for n in range(6):
        take = [5, 1, 3, 5, 2, 4][n]
        got = graphed.run(rows[0][:take], tokens_for(n, take)).cpu()
        want = eager.run(rows[1][:take], tokens_for(n, take)).cpu()
        assert torch.equal(got, want), n
    for a, b in zip(rows[0], rows[1], strict=True):
        assert torch.equal(managers[0].gather_self(a).cpu(), managers[1].gather_self(b).cpu())


def test_decode_request_ceilings_bound_the_steps():
    """A row stepped to its ceiling is refused by the step like by the manager (nothing changes)."""
    decoder, cfg = make(max_rows=2)
    manager = fast.DecoderKVCacheManager(cfg)
    group = PagedDecoderKV.admit(manager, [DecoderRequest(1, 1, 0)], fast)
    with torch.no_grad():
        decoder.prefill(group, torch.full((1, 1), decoder.config.sos))
    stepper = FastDecodeStep(decoder, manager)
    stepper.run(group.rows, [4])
    before = manager.describe(group.rows[0])
    with pytest.raises(ValueError, match="at its ceiling"):
        stepper.run(group.rows, [5])
    assert manager.describe(group.rows[0]) == before
