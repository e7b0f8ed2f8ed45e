"""Decode families as a registry: what a model must have to be decoded one way, and that way's options.

A family is a name, an options dataclass (its knobs; never new engine fields) and its entry in
:data:`CAPABILITIES`: the dotted attribute paths a model must carry, each with a one-line reason. An engine
resolves its family once, at construction (:func:`resolve_decode_family`): the model is checked against the
table and a model that lacks anything is refused with one line naming every missing member and why.

* ``ctc_prefix_beam`` (alias ``beam``): the twins' streaming CTC prefix beam search (``oasr.ctc``);
  options :class:`CtcBeamOptions`; served by ``StreamingEngine(decoder="beam")``.
* ``ctc_greedy`` (alias ``greedy``): greedy CTC collapse (``oasr.engine.decoding``); no options;
  ``StreamingEngine(decoder="greedy")``.
* ``rnnt_greedy``: transducer greedy search batched over the cohort (``oasr.reference/fast.rnnt_greedy``);
  options :class:`RnntGreedyOptions`; served by ``oasr.asr.transducer.TransducerRecognizer``.

``StreamingEngine``'s ``decoder="beam"`` / ``"greedy"`` are the aliases of the two CTC families.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Capability:
    """One member a family needs: ``path`` is dotted from the model (``"transducer.predict"``)."""

    path: str
    why: str


@dataclass(frozen=True)
class NoOptions:
    """A family without knobs."""


@dataclass(frozen=True)
class CtcBeamOptions:
    """The CTC prefix beam search's knobs (``oasr.ctc.config.CtcDecoderConfig``'s main fields)."""

    beam_size: int = 4
    nbest: int = 1

    def __post_init__(self):
        if self.beam_size < 1 or not 1 <= self.nbest <= self.beam_size:
            raise ValueError(f"ctc_prefix_beam: need beam_size >= 1 and 1 <= nbest <= beam_size, got {self}")


@dataclass(frozen=True)
class RnntGreedyOptions:
    """Transducer greedy search: ``max_symbols_per_step`` (``None``: the checkpoint's), the twin that runs it."""

    max_symbols_per_step: int | None = None
    twin: str = "fast"

    def __post_init__(self):
        if self.max_symbols_per_step is not None and self.max_symbols_per_step < 1:
            raise ValueError(f"rnnt_greedy: max_symbols_per_step must be >= 1, got {self.max_symbols_per_step}")
        if self.twin not in ("reference", "fast"):
            raise ValueError(f"rnnt_greedy: twin must be 'reference' or 'fast', got {self.twin!r}")


_CTC = (Capability("config.vocab_size", "the CTC output layer's size (blank is id 0): the streaming backend's "
                                         "chunk step returns log-probabilities over it"),)

#: family -> the model members it needs (the answer to "what must a model implement to support family X").
CAPABILITIES: dict[str, tuple[Capability, ...]] = {
    "ctc_prefix_beam": _CTC,
    "ctc_greedy": _CTC,
    "rnnt_greedy": (
        Capability("transducer.spec.blank_id", "the blank symbol the search moves frames on"),
        Capability("transducer.spec.max_symbols_per_step", "the checkpoint's cap on symbols per frame"),
        Capability("transducer.spec.state_specs", "the predictor's per-stream slot state (h, c, pending token)"),
        Capability("transducer.project_encoder", "encoder frames into the joint's space"),
        Capability("transducer.predict", "one prediction-network step"),
        Capability("transducer.joint", "the joint network's logits"),
    ),
}


@dataclass(frozen=True)
class DecodeFamily:
    name: str
    options_cls: type
    aliases: tuple = field(default=())

    def options(self, given=None):
        """``given`` (None, a dict of knobs or an options object) as this family's options object; an unknown
        knob is refused naming the valid ones."""
        if given is None:
            return self.options_cls()
        if isinstance(given, self.options_cls):
            return given
        if not isinstance(given, dict):
            raise ValueError(f"decode family {self.name!r}: options must be a dict or {self.options_cls.__name__}, "
                             f"got {type(given).__name__}")
        valid = [f.name for f in dataclasses.fields(self.options_cls)]
        unknown = sorted(set(given) - set(valid))
        if unknown:
            raise ValueError(f"decode family {self.name!r}: unknown option(s) {unknown}; valid: {valid or 'none'}")
        return self.options_cls(**given)

    def missing(self, model) -> list[Capability]:
        """The capabilities ``model`` lacks (empty: it can be served by this family)."""
        out = []
        for cap in CAPABILITIES[self.name]:
            obj = model
            for part in cap.path.split("."):
                if not hasattr(obj, part):
                    out.append(cap)
                    break
                obj = getattr(obj, part)
        return out

    def validate(self, model) -> None:
        """``ValueError`` naming every missing member and why, or nothing."""
        missing = self.missing(model)
        if missing:
            what = "; ".join(f"{c.path} ({c.why})" for c in missing)
            raise ValueError(f"{type(model).__name__} cannot be decoded with {self.name!r}: it lacks {what}")


_FAMILIES: dict[str, DecodeFamily] = {}


def register_decode_family(family: DecodeFamily) -> None:
    """Register ``family`` under its name and aliases (it needs a ``CAPABILITIES`` entry)."""
    if family.name not in CAPABILITIES:
        raise ValueError(f"register_decode_family: {family.name!r} has no entry in CAPABILITIES")
    for name in (family.name, *family.aliases):
        if name in _FAMILIES and _FAMILIES[name] is not family:
            raise ValueError(f"register_decode_family: {name!r} is already registered")
        _FAMILIES[name] = family


def list_decode_families() -> list[str]:
    """The registered family names (aliases not repeated)."""
    return sorted({f.name for f in _FAMILIES.values()})


def get_decode_family(name: str) -> DecodeFamily:
    """The family called ``name`` (or an alias); ``ValueError`` naming the known ones."""
    if name not in _FAMILIES:
        raise ValueError(f"unknown decode family {name!r}; known: {', '.join(list_decode_families())}")
    return _FAMILIES[name]


def resolve_decode_family(name: str, model, options=None):
    """Once, at engine construction: the family, the model checked against it, its options -> (family, options)."""
    family = get_decode_family(name)
    family.validate(model)
    return family, family.options(options)


register_decode_family(DecodeFamily("ctc_prefix_beam", CtcBeamOptions, aliases=("beam",)))
register_decode_family(DecodeFamily("ctc_greedy", NoOptions, aliases=("greedy",)))
register_decode_family(DecodeFamily("rnnt_greedy", RnntGreedyOptions))
