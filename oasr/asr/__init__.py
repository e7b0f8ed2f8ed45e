"""Speech in, text out: the shipped model, its front end and recipe (``Recognizer`` is in ``oasr.asr.recognizer``).

``AudioError`` (from ``oasr.asr.audio``) is what every refusal of bad audio raises.
"""

from oasr.asr.audio import AudioError

__all__ = ["AudioError"]
