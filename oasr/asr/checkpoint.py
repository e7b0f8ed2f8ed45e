"""The speech model on disk: one safetensors file, read without pickle, checked before it is used.

Layout: tensors ``encoder.*`` (the ``StreamingConformer``), ``decoder.*`` (the ``AttentionDecoder``),
``cmvn.mean`` and ``cmvn.istd``; the header's string metadata holds ``format`` (``FORMAT``),
``spec`` (``AsrSpec`` as JSON: geometry, alphabet, rescoring weight), ``info`` (JSON: how it was
trained), ``weights`` (the dtype the floating-point weights are stored in: ``float32``, or ``float16``
to halve the file; they are loaded into the model's float32 parameters either way; absent means
``float32``) and ``sha256``, a digest of every tensor's name, dtype, shape and bytes.

``load_checkpoint`` refuses, with one ``ValueError`` naming what is wrong, a file that is not
safetensors, a foreign safetensors file (no or another ``format``), a spec this code cannot build,
missing, extra or misshapen tensors, a digest mismatch (a corrupted or edited file) and non-finite
weights. Nothing of the file is executed: safetensors stores raw bytes and JSON.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from oasr.asr.model import AsrSpec, build
from oasr.features.fbank import GlobalCmvn

FORMAT = "oasr-asr-1"
WEIGHT_DTYPES = {"float32": torch.float32, "float16": torch.float16}  # what ``weights`` may say


def _digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def checkpoint_tensors(encoder, decoder, cmvn: GlobalCmvn, weights: str = "float32") -> dict:
    """Every tensor a checkpoint holds, on the CPU: ``encoder.*``, ``decoder.*`` (floating-point ones in
    ``weights``, a ``WEIGHT_DTYPES`` name) and the CMVN statistics (float32)."""
    dtype = WEIGHT_DTYPES[weights]

    def stored(v):
        v = v.detach().cpu()
        return (v.to(dtype) if v.is_floating_point() else v).contiguous()

    tensors = {f"encoder.{k}": stored(v) for k, v in encoder.state_dict().items()}
    tensors.update({f"decoder.{k}": stored(v) for k, v in decoder.state_dict().items()})
    tensors["cmvn.mean"] = cmvn.mean.detach().cpu().float().contiguous()
    tensors["cmvn.istd"] = cmvn.istd.detach().cpu().float().contiguous()
    return tensors


def save_checkpoint(path, encoder, decoder, spec: AsrSpec, cmvn: GlobalCmvn, info: dict | None = None,
                    weights: str = "float32") -> None:
    """Write the model, its spec, the CMVN statistics and ``info`` as one checksummed safetensors file,
    the floating-point weights stored as ``weights`` (``"float32"``, or ``"float16"``: half the bytes)."""
    from safetensors.torch import save_file

    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"save_checkpoint: weights must be one of {sorted(WEIGHT_DTYPES)}, got {weights!r}")
    tensors = checkpoint_tensors(encoder, decoder, cmvn, weights)
    meta = {"format": FORMAT, "spec": json.dumps(spec.to_dict(), sort_keys=True),
            "info": json.dumps(info or {}, sort_keys=True), "weights": weights, "sha256": _digest(tensors)}
    save_file(tensors, str(path), metadata=meta)


def read_header(path) -> dict:
    """The string metadata of a checkpoint file (``ValueError`` if it is not safetensors)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a malformed header
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None


def default_model_path() -> Path:
    """The model shipped with the package (``oasr/assets/model/model.safetensors``)."""
    # from this file, not importlib.resources: right even when a clone named oasr was imported as the package
    return Path(__file__).resolve().parents[1] / "assets" / "model" / "model.safetensors"


def serving_chunking(path=None) -> tuple[int, int]:
    """``(chunk_size, num_left_chunks)`` a checkpoint (default: the shipped model) serves with by default,
    read from its header alone."""
    if path is None:
        path = default_model_path()
    enc = json.loads(read_header(path)["spec"])["encoder"]
    return int(enc["chunk_size"]), int(enc["num_left_chunks"])


def load_checkpoint(path, **encoder_overrides):
    """``(encoder, decoder, spec, cmvn, info)`` from ``path``; ``encoder_overrides`` (e.g. ``chunk_size``,
    ``num_left_chunks``) change serving fields of the encoder config, never its geometry."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = read_header(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: not an oasr speech model (format {meta.get('format')!r}, expected {FORMAT!r})")
    weights = meta.get("weights", "float32")
    if weights not in WEIGHT_DTYPES:
        raise ValueError(f"{path}: weights stored as {weights!r}, this code reads {sorted(WEIGHT_DTYPES)}")
    try:
        spec = AsrSpec.from_dict(json.loads(meta["spec"]))
        info = json.loads(meta.get("info", "{}"))
        encoder, decoder = build(spec, **encoder_overrides)
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: the model description cannot be built ({exc})") from None
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: the tensor data cannot be read ({exc})") from None
    if _digest(tensors) != meta.get("sha256"):
        raise ValueError(f"{path}: checksum mismatch: the file is corrupted or was edited")
    expected = checkpoint_tensors(encoder, decoder, GlobalCmvn(torch.zeros(80), torch.ones(80)), weights)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"{path}: tensors do not match the model (missing {missing[:5]}, unexpected {extra[:5]})")
    for name, ref in expected.items():
        t = tensors[name]
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise ValueError(f"{path}: {name} is {t.dtype}{tuple(t.shape)}, "
                             f"the model needs {ref.dtype}{tuple(ref.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{path}: {name} holds non-finite values")
    encoder.load_state_dict({k[8:]: v for k, v in tensors.items() if k.startswith("encoder.")})
    decoder.load_state_dict({k[8:]: v for k, v in tensors.items() if k.startswith("decoder.")})
    encoder.eval()
    decoder.eval()
    return encoder, decoder, spec, GlobalCmvn(tensors["cmvn.mean"], tensors["cmvn.istd"]), info
