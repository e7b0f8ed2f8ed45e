"""The streaming engine: many streams over one shared pool, either twin (see ``streaming``)."""

from oasr.engine.decoding import GreedyCtcDecoder, decode_utterance, greedy_ctc_collapse
from oasr.engine.metrics import memory_utilisation
from oasr.engine.streaming import StepOutput, StreamingEngine, StreamResult, TickStats

__all__ = [
    "GreedyCtcDecoder",
    "StepOutput",
    "StreamResult",
    "StreamingEngine",
    "TickStats",
    "decode_utterance",
    "greedy_ctc_collapse",
    "memory_utilisation",
]
