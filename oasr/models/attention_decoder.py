"""A small seeded attention decoder (U2/WeNet's second pass, or a Whisper-like AED), cached incrementally.

``AttentionDecoder(DecoderConfig(seed=...))`` builds the same weights on every
machine. Each layer (pre-norm)::

    x = x + SelfAttn(LN(x))      causal, over the decoder's own K/V (the decoder cache's self region)
    x = x + CrossAttn(LN(x), e)  over the encoder output e (the cache's cross region, filled once)
    x = x + FFN(LN(x))

Tokens: ``sos == eos == vocab_size - 1`` (WeNet's convention); position p adds
a sinusoidal embedding, so any length is served. Three ways to run it, which
must agree:

* ``forward_full(tokens, enc)``: teacher-forced, all positions at once under a
  causal mask (the oracle; also what rescoring uses);
* ``prefill(kv, prompt)`` then ``step(kv, tokens)``: the prompt attends to itself
  fresh, in the served dtype, and its K/V are written into the cache; every later
  step writes one token per row and reads the cache (dense or paged, any twin);
* ``greedy`` / ``beam_search`` on top of those two.

With fp8 K/V the cache stores rounded K/V, so the incremental forward equals
``forward_full(..., kv_round=..., fresh=len(prompt))``: the prompt's queries
attend to unrounded self K/V, every later query to rounded ones, and every
query reads rounded cross K/V.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from oasr import layers
from oasr.decoder.config import DecoderCacheConfig, DecoderRequest
from oasr.decoder.kv import PagedDecoderKV
from oasr.models.layers import FeedForward, masked_attention


@dataclass
class DecoderConfig:
    vocab_size: int = 32
    encoder_dim: int = 32
    hidden_dim: int = 32
    num_layers: int = 2
    n_head: int = 4
    n_kv_head: int = 2
    head_dim: int = 16
    ffn_dim: int = 64
    seed: int = 0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "seed":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{f.name} must be a positive int, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"DecoderConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        if self.vocab_size < 2:
            raise ValueError(f"DecoderConfig.vocab_size must be >= 2 (sos/eos is the last id), got {self.vocab_size}")

    @property
    def sos(self) -> int:
        """The start-of-sequence token id (the last of the vocabulary, shared with eos)."""
        return self.vocab_size - 1

    @property
    def eos(self) -> int:
        """The end-of-sequence token id (the last of the vocabulary, shared with sos)."""
        return self.vocab_size - 1

    def cache_config(self, **overrides) -> DecoderCacheConfig:
        """A ``DecoderCacheConfig`` with this decoder's geometry; capacity fields overridable."""
        values = dict(num_layers=self.num_layers, n_kv_head=self.n_kv_head, head_dim=self.head_dim,
                      page_size=4, max_rows=8, max_self_tokens=32, max_cross_tokens=64)
        values.update(overrides)
        if "max_num_blocks" not in values and "budget_bytes" not in values:
            probe = DecoderCacheConfig(**{**values, "max_num_blocks": 1})
            values["max_num_blocks"] = probe.max_rows * (probe.self_pages + probe.cross_pages)
        return DecoderCacheConfig(**values)


def sinusoid(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``(..., dim)`` sinusoidal embedding of integer positions (float64 angles)."""
    inv = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[..., None] * inv
    return torch.cat([angles.sin(), angles.cos()], dim=-1)[..., :dim].to(dtype)


class _Projections(nn.Module):
    def __init__(self, hidden: int, source: int, n_head: int, n_kv_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.norm = layers.LayerNorm(hidden)
        self.q = layers.Linear(hidden, n_head * head_dim)
        self.k = layers.Linear(source, n_kv_head * head_dim)
        self.v = layers.Linear(source, n_kv_head * head_dim)
        self.out = layers.Linear(n_head * head_dim, hidden)

    def query(self, h: torch.Tensor) -> torch.Tensor:
        B, T, _ = h.shape
        return self.q(h).view(B, T, self.n_head, self.head_dim)

    def keys(self, src: torch.Tensor):
        B, T, _ = src.shape
        return (self.k(src).view(B, T, self.n_kv_head, self.head_dim),
                self.v(src).view(B, T, self.n_kv_head, self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = _Projections(cfg.hidden_dim, cfg.hidden_dim, cfg.n_head, cfg.n_kv_head, cfg.head_dim)
        self.cross_attn = _Projections(cfg.hidden_dim, cfg.encoder_dim, cfg.n_head, cfg.n_kv_head, cfg.head_dim)
        self.ffn = FeedForward(cfg.hidden_dim, cfg.ffn_dim)


def _heads_first(q: torch.Tensor) -> torch.Tensor:
    return q.transpose(1, 2).contiguous()  # (B, T, nH, D) -> (B, nH, T, D)


def _merge_heads(o: torch.Tensor) -> torch.Tensor:
    B, nH, T, D = o.shape
    return o.transpose(1, 2).reshape(B, T, nH * D)


class AttentionDecoder(nn.Module):
    def __init__(self, config: DecoderConfig | None = None):
        super().__init__()
        self.config = cfg = config or DecoderConfig()
        self.embed = layers.Embedding(cfg.vocab_size, cfg.hidden_dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm_out = layers.LayerNorm(cfg.hidden_dim)
        self.out = layers.Linear(cfg.hidden_dim, cfg.vocab_size)
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g) / m.weight.shape[1] ** 0.5)
                    m.bias.copy_(0.02 * torch.randn(m.bias.shape, generator=g))
                elif isinstance(m, nn.LayerNorm):
                    m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=g))
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
                elif isinstance(m, nn.Embedding):
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g))
            self.out.weight.mul_(3.0)  # peakier next-token distributions
        self.eval()

    # ---- pieces ---------------------------------------------------------------------
    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return x + sinusoid(positions, self.config.hidden_dim, x.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm_out(x))

    def cross_kv(self, enc: torch.Tensor):
        """Cross K/V of one encoder output ``(S, encoder_dim)``: ``k, v (L, S, H, D)`` for ``fill_cross``."""
        ks, vs = zip(*(layer.cross_attn.keys(enc[None]) for layer in self.layers), strict=True)
        return torch.stack([k[0] for k in ks]), torch.stack([v[0] for v in vs])

    # ---- the oracle: all positions at once --------------------------------------------
    def forward_full(self, tokens: torch.Tensor, enc: torch.Tensor, enc_lens=None, kv_round=None,
                     fresh: int = 0) -> torch.Tensor:
        """Teacher-forced logits ``(B, T, V)`` for ``tokens (B, T)`` over ``enc (B, S, E)``, causal mask.

        ``kv_round(x)`` (optional) is applied to cached K/V as the fp8 cache stores them; queries before
        position ``fresh`` attend to unrounded self K/V (the prompt attends fresh).
        """
        B, T = tokens.shape
        S = enc.shape[1]
        lens = torch.full((B,), S) if enc_lens is None else torch.as_tensor(enc_lens)
        x = self._embed(tokens, torch.arange(T)[None].expand(B, T).to(tokens.device))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None].expand(B, T, T)
        cross_ok = (torch.arange(S)[None, :] < lens[:, None]).to(x.device)[:, None, :].expand(B, T, S)
        rnd = kv_round or (lambda t: t)
        for layer in self.layers:
            sa, ca = layer.self_attn, layer.cross_attn
            h = sa.norm(x)
            q = sa.query(h)
            k, v = sa.keys(h)
            out = masked_attention(q, rnd(k), rnd(v), causal)
            if kv_round is not None and fresh:
                out[:, :fresh] = masked_attention(q, k, v, causal)[:, :fresh]
            x = x + sa.out(out)
            ck, cv = ca.keys(enc)
            x = x + ca.out(masked_attention(ca.query(ca.norm(x)), rnd(ck), rnd(cv), cross_ok))
            x = x + layer.ffn(x)
        return self._logits(x)

    # ---- incremental ----------------------------------------------------------------------
    def fill_cross(self, kv, encs: list) -> None:
        """Fill each row's cross region from its encoder output ``(S_b, encoder_dim)``."""
        for b, enc in enumerate(encs):
            k, v = self.cross_kv(enc)
            kv.fill_cross(b, k, v)

    def prefill(self, kv, prompt: torch.Tensor) -> torch.Tensor:
        """Run ``prompt (B, T)`` (empty rows, cross filled); store its K/V; return the last logits ``(B, V)``.

        The prompt attends to its own K/V fresh, in the served dtype; the cache is written afterwards.
        """
        B, T = prompt.shape
        x = self._embed(prompt, torch.arange(T, device=prompt.device)[None].expand(B, T))
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None].expand(B, T, T)
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            sa, ca = layer.self_attn, layer.cross_attn
            h = sa.norm(x)
            q = sa.query(h)
            k, v = sa.keys(h)
            keys.append(k)
            values.append(v)
            x = x + sa.out(masked_attention(q, k, v, causal))
            x = x + ca.out(_merge_heads(kv.attend_cross(i, _heads_first(ca.query(ca.norm(x))))))
            x = x + layer.ffn(x)
        K, V = torch.stack(keys), torch.stack(values)  # (L, B, T, H, D)
        for b in range(B):
            kv.prefill(b, K[:, b].contiguous(), V[:, b].contiguous())
        return self._logits(x[:, -1])

    def step(self, kv, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row, ``tokens (B,)`` at each row's length; returns logits ``(B, V)``."""
        positions = torch.tensor(kv.lengths, device=tokens.device)
        kv.begin_step()
        logits = self.step_at(kv, tokens, positions)
        kv.end_step()
        return logits

    def step_at(self, kv, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device half of ``step``: ``tokens (B,)`` at ``positions (B,)``, between the group's
        ``begin_step`` and ``end_step`` (which the caller runs). Reads no host value, so a group whose
        verbs launch over fixed addresses (``oasr.engine.decode_step``) can capture it in a graph."""
        B = tokens.shape[0]
        x = self._embed(tokens[:, None], positions[:, None])
        for i, layer in enumerate(self.layers):
            sa, ca = layer.self_attn, layer.cross_attn
            h = sa.norm(x)
            q = sa.query(h)
            k, v = sa.keys(h)
            kv.write(i, k.contiguous(), v.contiguous())
            x = x + sa.out(_merge_heads(kv.attend_self(i, _heads_first(q))))
            x = x + ca.out(_merge_heads(kv.attend_cross(i, _heads_first(ca.query(ca.norm(x))))))
            x = x + layer.ffn(x)
        return self._logits(x[:, 0]).view(B, -1)

    # ---- search ---------------------------------------------------------------------------
    def request(self, enc_len: int, max_new_tokens: int) -> DecoderRequest:
        """What a row of ``greedy`` / ``beam_search`` declares at admission: prompt [sos], cross enc_len."""
        return DecoderRequest(prompt_len=1, max_new_tokens=max_new_tokens, cross_len=enc_len)

    @torch.no_grad()
    def greedy(self, kv, encs: list, max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding of every row of ``kv`` (empty rows, one encoder output each) until eos."""
        B = len(encs)
        self.fill_cross(kv, encs)
        sos = torch.full((B, 1), self.config.sos, dtype=torch.long, device=self.out.weight.device)
        logits = self.prefill(kv, sos)
        hyps, done = [[] for _ in range(B)], [False] * B
        for n in range(max_new_tokens):
            tok = logits.argmax(dim=-1)
            for b in range(B):
                if not done[b]:
                    if int(tok[b]) == self.config.eos:
                        done[b] = True
                    else:
                        hyps[b].append(int(tok[b]))
            if all(done) or n == max_new_tokens - 1:
                break
            logits = self.step(kv, tok)
        return hyps

    @torch.no_grad()
    def beam_search(self, kv, enc: torch.Tensor, beam: int, max_new_tokens: int):
        """Beam search for one encoder output; ``kv`` is a one-row group, dense or paged (paged beams
        fork onto copy-on-write pages when rows repeat).

        Returns ``(tokens, log_prob)`` of the best hypothesis (eos-terminated ones score their eos).
        Stops when the best finished score is at least every live beam's (scores only fall).
        """
        eos = self.config.eos
        self.fill_cross(kv, [enc])
        device = self.out.weight.device
        sos = torch.full((1, 1), self.config.sos, dtype=torch.long, device=device)
        logp = F.log_softmax(self.prefill(kv, sos).float(), -1).cpu()
        alive, scores = [[]], torch.zeros(1)
        finished = []
        for n in range(max_new_tokens):
            total = (scores[:, None] + logp).view(-1)
            V = logp.shape[1]
            order = torch.argsort(total, descending=True, stable=True)[: 2 * beam]
            parents, tokens, new_scores, new_alive = [], [], [], []
            for flat in order.tolist():
                p, t = divmod(flat, V)
                if t == eos:
                    finished.append((alive[p], float(total[flat])))
                elif len(new_alive) < beam:
                    parents.append(p)
                    tokens.append(t)
                    new_scores.append(float(total[flat]))
                    new_alive.append(alive[p] + [t])
                if len(new_alive) == beam:
                    break
            best_finished = max((s for _, s in finished), default=-math.inf)
            if not new_alive or best_finished >= max(new_scores) or n == max_new_tokens - 1:
                pool = finished + list(zip(new_alive, new_scores, strict=True))
                return max(pool, key=lambda hs: hs[1])
            kv = kv.select(parents)
            alive, scores = new_alive, torch.tensor(new_scores)
            logp = F.log_softmax(self.step(kv, torch.tensor(tokens, device=device)).float(), -1).cpu()
        return [], -math.inf

    # ---- rescoring ------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, hyps: list[list[int]], enc: torch.Tensor) -> list[float]:
        """Decoder log-likelihood of each hypothesis (``sos + hyp -> hyp + eos``) given ``enc (S, E)``."""
        if not hyps:
            return []
        cfg = self.config
        T = max(len(h) for h in hyps) + 1
        inputs = torch.full((len(hyps), T), cfg.eos, dtype=torch.long)
        targets = torch.full((len(hyps), T), cfg.eos, dtype=torch.long)
        for i, h in enumerate(hyps):
            inputs[i, 1 : len(h) + 1] = torch.tensor(h, dtype=torch.long)
            inputs[i, 0] = cfg.sos
            targets[i, : len(h)] = torch.tensor(h, dtype=torch.long)
        device = self.out.weight.device
        logp = F.log_softmax(self.forward_full(inputs.to(device), enc[None].expand(len(hyps), -1, -1).to(device))
                             .float(), -1).cpu()
        picked = logp.gather(2, targets[..., None])[..., 0]
        valid = torch.arange(T)[None, :] <= torch.tensor([len(h) for h in hyps])[:, None]
        return (picked * valid).sum(dim=1).tolist()

    @torch.no_grad()
    def score_shared(self, hyps: list[list[int]], enc: torch.Tensor, manager, ops, scope) -> tuple[list[float], int]:
        """``score`` through a paged ``DecoderKVCacheManager``, sharing the prefixes the hypotheses have in
        common (the n-best of one utterance mostly differ at the end).

        Each hypothesis ``[sos] + hyp`` is admitted with ``admit_prompt(row, tokens, scope)``: its cached
        pages are bound, not recomputed; the rest is fed one token per ``step`` over the cache; the row is
        then ``retire``d so the next hypothesis can hit it. The log-probabilities of cached positions come
        from a host memo of this call. ``scope`` must name the utterance: past the first layer the K/V
        depend on ``enc`` (``oasr.decoder.prefix_cache``). Returns ``(scores, tokens computed)``.
        """
        cfg, device = self.config, self.out.weight.device
        memo: dict[tuple, torch.Tensor] = {}  # prefix tokens -> log-probs of the next token
        scores, computed = [], 0
        for hyp in hyps:
            tokens = [cfg.sos, *hyp]
            kv = PagedDecoderKV.admit(manager, [DecoderRequest(len(tokens), 0, enc.shape[0])], ops)
            row = kv.rows[0]
            self.fill_cross(kv, [enc])
            cached = manager.admit_prompt(row, tokens, scope)
            if any(tuple(tokens[: i + 1]) not in memo for i in range(cached)):
                kv.finish()
                raise ValueError(f"score_shared: scope {scope!r} hit pages published by an earlier call; give "
                                 f"each call (utterance) its own scope")
            for i in range(cached, len(tokens)):  # every uncached token writes its K/V
                logits = self.step(kv, torch.tensor([tokens[i]], device=device))
                memo[tuple(tokens[: i + 1])] = F.log_softmax(logits.float(), -1)[0].cpu()
                computed += 1
            targets = [*hyp, cfg.eos]
            scores.append(sum(float(memo[tuple(tokens[: i + 1])][t]) for i, t in enumerate(targets)))
            manager.retire(row, tokens, scope)
        return scores, computed


def attention_rescore(decoder: AttentionDecoder, enc: torch.Tensor, nbest, ctc_weight: float = 0.5, cache=None):
    """U2/WeNet's second pass: pick the CTC n-best hypothesis maximising decoder_ll + ctc_weight * ctc_score.

    ``nbest``: ``CtcHypothesis`` records (``tokens``, ``log_score``). Returns ``(tokens, scores)`` where
    ``scores[i]`` is hypothesis i's combined score. ``cache=(manager, ops, scope)`` scores through a paged
    decoder cache with ``AttentionDecoder.score_shared`` (shared prefixes computed once; ``scope`` names
    the utterance); without it, one teacher-forced forward (``score``).
    """
    hyps = [list(h.tokens) for h in nbest]
    if not hyps:
        return [], []
    dec = decoder.score(hyps, enc) if cache is None else decoder.score_shared(hyps, enc, *cache)[0]
    combined = [d + ctc_weight * float(h.log_score) for d, h in zip(dec, nbest, strict=True)]
    best = max(range(len(hyps)), key=lambda i: combined[i])
    return hyps[best], combined
