"""Speech activity and endpointing: when a turn starts and when it has ended.

Two halves, kept apart on purpose:

* **detectors** (``oasr.vad.detectors``) turn a signal into a per-frame speech probability: the CTC blank
  posterior a recognizer already computes (``1 - p(blank)``, on the encoder's frame grid), or the energy of
  the PCM itself where no posteriors exist (``EnergyDetector``);
* **the endpointer** (``oasr.vad.endpointer``) is policy over those probabilities: a turn starts after a short
  run of speech, ends after a configurable stretch of trailing silence or at a maximum length, and says so as
  events with times. It knows nothing of models, so it is tested on synthetic probability traces alone, and
  every detector gets the same segment semantics, the same knobs and the same events.

``Endpointer`` is the readable per-stream state machine (the oracle); ``EndpointerBank`` advances many
streams' endpointers at once with array arithmetic and must emit exactly the same events.
"""

from oasr.vad.detectors import EnergyDetector, ctc_speech_probability
from oasr.vad.endpointer import EndpointConfig, Endpointer, EndpointerBank, EndpointEvent

__all__ = ["EndpointConfig", "EndpointEvent", "Endpointer", "EndpointerBank", "EnergyDetector",
           "ctc_speech_probability"]
