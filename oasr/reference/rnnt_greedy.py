"""Reference RNN-T greedy decoding: the plain per-stream loop, the oracle of ``oasr.fast.rnnt_greedy``.

For each stream, for each encoder frame ``t`` of the chunk: evaluate the predictor on the pending token
(``g``), the joint on ``(e_t, g)``, take the argmax; a blank moves to the next frame; a token is emitted,
commits the predictor state and stays on the frame, until ``max_symbols_per_step`` tokens were emitted
on it (then the loop moves on). The state is ``TransducerSpec.state_specs()``: ``h``/``c``
``(layers, B, H)`` and ``last`` ``(B, 1)`` (0 = blank, ``k + 1`` = token ``k``); see ``oasr.models.transducer``.

``decode_chunk(head, enc, state, num_frames=None, max_symbols=None) -> (tokens, frames, new_state)``:
``enc`` ``(B, T, encoder_dim)`` encoder outputs (projected here), ``num_frames`` how many of the ``T``
frames each stream has (default all); ``tokens[b]`` and ``frames[b]`` (frame index within the chunk) list
stream ``b``'s emissions in order. ``state`` is not modified; ``new_state`` is fresh tensors.

``head`` is a ``oasr.models.transducer.TransducerHead`` (or anything with its ``spec``, ``project_encoder``,
``predict`` and ``joint``: this layer does not import the models).
"""

from __future__ import annotations

import torch


def check_inputs(head, enc: torch.Tensor, state: dict, num_frames, max_symbols):
    """Shared validation of both twins: ``(num_frames list, max_symbols)`` or ``ValueError`` naming the mismatch."""
    spec = head.spec
    if enc.dim() != 3 or enc.shape[-1] != spec.encoder_dim:
        raise ValueError(f"rnnt decode: enc must be (B, T, {spec.encoder_dim}), got {tuple(enc.shape)}")
    batch, frames = enc.shape[0], enc.shape[1]
    hc = (spec.pred_layers, batch, spec.pred_hidden)
    want = {"rnnt_h": hc, "rnnt_c": hc, "rnnt_last": (batch, 1)}
    for name, shape in want.items():
        got = tuple(state[name].shape) if name in state else None
        if got != shape:
            raise ValueError(f"rnnt decode: state {name!r} must be {shape}, got {got}")
    if num_frames is None:
        num_frames = [frames] * batch
    num_frames = [int(n) for n in num_frames]
    if len(num_frames) != batch or any(not 0 <= n <= frames for n in num_frames):
        raise ValueError(f"rnnt decode: num_frames must be {batch} counts in [0, {frames}], got {num_frames}")
    max_symbols = spec.max_symbols_per_step if max_symbols is None else int(max_symbols)
    if max_symbols <= 0:
        raise ValueError(f"rnnt decode: max_symbols_per_step must be > 0, got {max_symbols}")
    return num_frames, max_symbols


@torch.no_grad()
def decode_chunk(head, enc: torch.Tensor, state: dict, num_frames=None, max_symbols=None):
    """One chunk for ``B`` streams, stream by stream (see the module docstring)."""
    num_frames, max_symbols = check_inputs(head, enc, state, num_frames, max_symbols)
    blank = head.spec.blank_id
    e_all = head.project_encoder(enc)
    new = {k: v.clone() for k, v in state.items()}
    tokens, frames = [], []
    for b in range(enc.shape[0]):
        h, c = state["rnnt_h"][:, b : b + 1], state["rnnt_c"][:, b : b + 1]
        last = state["rnnt_last"][b]
        toks, where = [], []
        for t in range(num_frames[b]):
            for _ in range(max_symbols):
                g, h2, c2 = head.predict(last, h, c)
                k = int(head.joint(e_all[b, t], g[0]).argmax())
                if k == blank:
                    break
                toks.append(k)
                where.append(t)
                h, c, last = h2, c2, torch.tensor([k + 1], dtype=torch.int64)
        new["rnnt_h"][:, b : b + 1], new["rnnt_c"][:, b : b + 1] = h, c
        new["rnnt_last"][b] = last
        tokens.append(toks)
        frames.append(where)
    return tokens, frames, new
