"""The training recipe: joint CTC / attention training with dynamic chunks on synthesized speech.

``python -m oasr train --work DIR`` runs it end to end: synthesize the training shards (espeak-ng,
``oasr.asr.data``), measure the global CMVN, then train the project's ``StreamingConformer`` with a CTC
head jointly with the ``AttentionDecoder`` (so the second pass that rescores the CTC n-best is a real
model, not a random one). Each batch draws its attention mask: full context with probability 1/2,
otherwise a chunk of 1-25 encoder frames and a left context of 1-8 chunks or unlimited (WeNet's
dynamic chunk training), so one checkpoint serves every chunk size and left window the caches offer.
With ``serving_share`` > 0 that share of the batches is drawn at the serving chunk and left context
instead (a later phase of the shipped model's schedule: it closes the gap between the streaming first
pass and full context at the default chunk, and the other chunkings stay in the mix).

Everything is seeded; ``DIR/state.pt`` (tensors only, read back with ``weights_only=True``) is written
every ``--save-every`` steps and a rerun resumes from it exactly: the state holds the batches of the
current epoch already done and the random generators (dropout, SpecAugment), and the epoch's chunking
draws are replayed, so an interrupted run and an uninterrupted one with the same options end with the
same weights (a state saved before this was recorded restarts its epoch's batch order). The weights
shipped with the package are the exponential moving average of the trained weights (``--ema``),
exported with ``oasr.asr.checkpoint``.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from oasr.asr.data import ShardSet
from oasr.asr.model import AsrSpec, build
from oasr.features.fbank import GlobalCmvn


def batches(lens: np.ndarray, max_frames: int, rng: random.Random) -> list[list[int]]:
    """Length-bucketed batches of utterance indices, at most ``max_frames`` padded frames each, shuffled."""
    order = sorted(range(len(lens)), key=lambda i: (int(lens[i]), rng.random()))
    out, cur, longest = [], [], 0
    for i in order:
        longest_new = max(longest, int(lens[i]))
        if cur and longest_new * (len(cur) + 1) > max_frames:
            out.append(cur)
            cur, longest_new = [], int(lens[i])
        cur.append(i)
        longest = longest_new
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def spec_augment(x: torch.Tensor, lens: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Two frequency masks (<= 10 bins) and two time masks (<= 5% of each row, <= 40 frames), in place."""
    B, T, D = x.shape
    for b in range(B):
        for _ in range(2):
            w = int(torch.randint(0, 11, (1,), generator=g))
            f0 = int(torch.randint(0, D - w + 1, (1,), generator=g))
            x[b, :, f0 : f0 + w] = 0
        n = int(lens[b])
        for _ in range(2):
            w = int(torch.randint(0, max(1, min(40, n // 20)) + 1, (1,), generator=g))
            t0 = int(torch.randint(0, max(1, n - w + 1), (1,), generator=g))
            x[b, t0 : t0 + w] = 0
    return x


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then a cosine decay to 5% of it at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * done)))


def draw_chunking(rng: random.Random, serving: tuple[int, int] | None = None,
                  serving_share: float = 0.0) -> tuple[int, int]:
    """(chunk_size, num_left_chunks) for one batch.

    ``serving_share`` of the batches take ``serving`` (the spec's chunk and left context); of the rest,
    half run full context and half a random chunk of 1-25 frames with 1-8 or unlimited left chunks. With
    ``serving_share == 0`` the draws (and so a seeded run) are those of the original schedule."""
    if serving_share > 0 and rng.random() < serving_share:
        return serving
    if rng.random() < 0.5:
        return 100000, -1
    return rng.randint(1, 25), rng.choice([-1, 1, 2, 3, 4, 6, 8])


def joint_loss(encoder, decoder, tokenizer, x, lens, targets, chunk, left, ctc_weight=0.3, smoothing=0.1):
    """``ctc_weight * CTC + (1 - ctc_weight) * label-smoothed attention CE``, both per utterance."""
    hidden, hlens = encoder.encode(x, lens, chunk_size=chunk, num_left_chunks=left)
    logp = F.log_softmax(encoder.ctc(hidden), dim=-1)
    device = hidden.device
    flat = torch.tensor([t for ys in targets for t in ys], dtype=torch.long, device=device)
    tlens = torch.tensor([len(ys) for ys in targets], dtype=torch.long, device=device)
    ctc = F.ctc_loss(logp.transpose(0, 1), flat, hlens, tlens, blank=tokenizer.blank_id, reduction="sum",
                     zero_infinity=True) / len(targets)
    eos = tokenizer.sos_eos_id
    U = max(len(ys) for ys in targets) + 1
    ys_in = torch.full((len(targets), U), eos, dtype=torch.long)
    ys_out = torch.full((len(targets), U), -1, dtype=torch.long)
    for b, ys in enumerate(targets):
        ys_in[b, 1 : len(ys) + 1] = torch.tensor(ys, dtype=torch.long)
        ys_out[b, : len(ys)] = torch.tensor(ys, dtype=torch.long)
        ys_out[b, len(ys)] = eos
    ys_in, ys_out = ys_in.to(device), ys_out.to(device)
    logits = decoder.forward_full(ys_in, hidden, hlens)
    att = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ys_out.reshape(-1), ignore_index=-1,
                          label_smoothing=smoothing, reduction="sum") / len(targets)
    return ctc_weight * ctc + (1 - ctc_weight) * att, ctc.detach(), att.detach()


def greedy_wer(encoder, tokenizer, cmvn, shards: ShardSet, count: int, chunk: int, left: int,
               device: str = "cpu") -> float:
    """Greedy CTC WER on the first ``count`` utterances of ``shards`` (a quick check while training)."""
    from oasr.asr.metrics import error_rates

    refs, hyps = [], []
    with torch.no_grad():
        for i in range(min(count, len(shards))):
            x = torch.as_tensor(cmvn.normalize(shards.utterance(i).astype(np.float32))[None]).to(device)
            hidden, _ = encoder.encode(x, None, chunk_size=chunk, num_left_chunks=left)
            ids = encoder.ctc(hidden)[0].argmax(-1).tolist()
            collapsed = [t for j, t in enumerate(ids) if t != 0 and (j == 0 or ids[j - 1] != t)]
            refs.append(shards.texts[i])
            hyps.append(tokenizer.decode(collapsed))
    return error_rates(refs, hyps)["wer"]


def train(work: Path, steps: int, seed: int = 0, max_frames: int = 10000, lr: float = 2e-3,
          warmup: int = 400, ema_decay: float = 0.999, save_every: int = 200, log_every: int = 25,
          dev_every: int = 1000, dev_dir: Path | None = None, spec: AsrSpec | None = None, serving_share: float = 0.0,
          stop_at: int | None = None, device: str = "cpu", init=None, voice_dev_dir: Path | None = None,
          log=print) -> dict:
    """Train for ``steps`` optimizer steps on the shards in ``work/train`` (resuming ``work/state.pt``).

    ``serving_share`` (0 <= share < 1) is the share of batches drawn at the serving chunking
    (``draw_chunking``). ``stop_at`` ends this call at that step with the state saved, as an interruption
    would (the learning-rate schedule still runs to ``steps``). Every ``dev_every`` steps (and at the end)
    the EMA weights' greedy streaming WER on ``dev_dir`` is logged, and on ``voice_dev_dir`` too when given
    (the recipe's voice dev shard: held-out English examples by random voices). ``device`` (``"cpu"`` or ``"cuda[:N]"``)
    runs the model there; batches, SpecAugment and every random draw stay on the CPU, so the data order and
    masks are those of a CPU run, and the returned networks are back on the CPU. ``init``: an exported
    checkpoint (``save_checkpoint``) of the same geometry whose weights and CMVN a fresh run starts from
    (fine-tuning; the EMA starts there too); ignored when ``work/state.pt`` resumes a run. ``ValueError``
    when its geometry is not ``spec``'s."""
    if not 0.0 <= serving_share < 1.0:
        raise ValueError(f"serving_share must be in [0, 1), got {serving_share}")
    work = Path(work)
    spec = spec or AsrSpec()
    tok = spec.tokenizer()
    torch.manual_seed(seed)
    encoder, decoder = build(spec)
    encoder.to(device)
    decoder.to(device)
    encoder.train()
    decoder.train()
    params = list(encoder.parameters()) + list(decoder.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=1e-3)
    ema = [p.detach().clone() for p in params]
    step, epoch, cmvn, skip = 0, 0, None, 0
    g = torch.Generator().manual_seed(seed)
    state_path = work / "state.pt"
    if init is not None and not state_path.exists():
        from oasr.asr.checkpoint import load_checkpoint

        start_enc, start_dec, start_spec, cmvn, _ = load_checkpoint(init)
        if start_spec.to_dict() != spec.to_dict():
            raise ValueError(f"train: {init} is a {start_spec.to_dict()} model, this run trains {spec.to_dict()}")
        for p, v in zip(params, list(start_enc.parameters()) + list(start_dec.parameters()), strict=True):
            p.data.copy_(v.to(device))
        ema = [p.detach().clone() for p in params]
        log(f"starting from {init} (its weights and CMVN)")
    if state_path.exists():
        state = torch.load(state_path, weights_only=True, map_location=device)
        for p, v in zip(params, state["params"], strict=True):
            p.data.copy_(v)
        for e, v in zip(ema, state["ema"], strict=True):
            e.copy_(v)
        opt.load_state_dict(state["opt"])
        step, epoch = int(state["step"]), int(state["epoch"])
        cmvn = GlobalCmvn(state["cmvn_mean"].cpu(), state["cmvn_istd"].cpu())
        if "epoch_batch" in state:  # exact resumption (older states restart their epoch's batch order)
            skip = int(state["epoch_batch"])
            torch.set_rng_state(state["torch_rng"].cpu())
            g.set_state(state["augment_rng"].cpu())
        log(f"resumed at step {step} (epoch {epoch}, batch {skip})")
    n_params = sum(p.numel() for p in params)
    n_enc = sum(p.numel() for p in encoder.parameters())
    log(f"encoder {n_enc:,} + decoder {n_params - n_enc:,} = {n_params:,} parameters, "
        f"{torch.get_num_threads()} threads")
    checks = [(name, ShardSet(d)) for name, d in (("dev", dev_dir), ("voice dev", voice_dev_dir))
              if d is not None and Path(d).exists()]
    serving = (spec.encoder["chunk_size"], spec.encoder["num_left_chunks"])
    t_start, seen, seen_frames = time.time(), 0, 0
    losses = []
    end = steps if stop_at is None else min(steps, stop_at)
    done_in_epoch = skip

    def save():
        torch.save({"params": [p.detach() for p in params], "ema": ema, "opt": opt.state_dict(),
                    "step": torch.tensor(step), "epoch": torch.tensor(epoch), "cmvn_mean": cmvn.mean,
                    "cmvn_istd": cmvn.istd, "epoch_batch": torch.tensor(done_in_epoch),
                    "torch_rng": torch.get_rng_state(), "augment_rng": g.get_state()}, work / "state.tmp")
        (work / "state.tmp").replace(state_path)

    while step < end:
        data = None  # the last epoch's features go before the next epoch's are read (two copies: twice the memory)
        data = ShardSet(work / "train")  # shards still being synthesized join at the next epoch
        if cmvn is None:
            cmvn = GlobalCmvn.from_stats(*data.stats)
        rng = random.Random(f"{seed}/{epoch}")
        plan = batches(data.lens, max_frames, rng)
        log(f"epoch {epoch}: {len(data)} utterances, {len(plan)} batches")
        for k, idx in enumerate(plan):
            if k < skip:  # done before the interruption: replay its chunking draw, nothing else
                draw_chunking(rng, serving, serving_share)
                continue
            if step >= end:
                break
            lens = torch.tensor([int(data.lens[i]) for i in idx])
            x = torch.zeros(len(idx), int(lens.max()), 80)
            for b, i in enumerate(idx):
                x[b, : lens[b]] = cmvn.normalize(data.utterance(i).astype(np.float32))
            spec_augment(x, lens, g)
            targets = [tok.encode(data.texts[i]) for i in idx]
            chunk, left = draw_chunking(rng, serving, serving_share)
            for group in opt.param_groups:
                group["lr"] = learning_rate(step, steps, lr, warmup)
            loss, ctc, att = joint_loss(encoder, decoder, tok, x.to(device), lens.to(device), targets, chunk, left)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            opt.step()
            step += 1
            done_in_epoch = k + 1
            with torch.no_grad():
                d = min(ema_decay, (1 + step) / (10 + step))
                for e, p in zip(ema, params, strict=True):
                    e.mul_(d).add_(p.detach(), alpha=1 - d)
            seen += len(idx)
            seen_frames += int(lens.sum())
            losses.append((float(ctc), float(att)))
            if step % log_every == 0:
                el = time.time() - t_start
                c, a = np.mean(losses, axis=0)
                losses.clear()
                log(f"step {step}/{steps} epoch {epoch} ctc {c:.3f} att {a:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                    f"{seen / el:.1f} utt/s {seen_frames / 100 / el:.1f}x audio elapsed {el / 60:.1f} min")
            if step % save_every == 0:
                save()
            if checks and (step % dev_every == 0 or step == end):
                live = [p.detach().clone() for p in params]
                with torch.no_grad():
                    for p, e in zip(params, ema, strict=True):
                        p.copy_(e)
                encoder.eval()
                wers = [(name, greedy_wer(encoder, tok, cmvn, shards, len(shards), *serving, device))
                        for name, shards in checks]
                encoder.train()
                with torch.no_grad():
                    for p, v in zip(params, live, strict=True):
                        p.copy_(v)
                for name, w in wers:
                    log(f"step {step}: {name} greedy streaming WER (EMA weights) {100 * w:.1f}%")
        else:
            epoch += 1
            done_in_epoch = 0
        skip = 0
    save()
    with torch.no_grad():
        for p, e in zip(params, ema, strict=True):
            p.copy_(e)
    encoder.cpu().eval()
    decoder.cpu().eval()
    return {"encoder": encoder, "decoder": decoder, "cmvn": cmvn, "spec": spec, "step": step,
            "seconds": time.time() - t_start}
