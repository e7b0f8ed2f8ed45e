"""``StreamingEngine``: many streams, one shared pool, one batched paged forward per tick.

A package because the engine's parts would not fit one file; ``engine.py`` draws the contract, the
state and one tick (its docstring), the others are mixins of the class, one idea each:

    engine.py       ``StreamingEngine``: its contract, construction (the model step picked), lifetime
    records.py      ``StepOutput``, ``StreamResult``, ``TickStats``, the per-stream record, the id rule
    streams.py      input and queries: add_stream, push, end_stream, cancel, status, ...
    admission.py    which waiting streams get a slot (``admission_order``) and their caches
    ticks.py        one tick (``step``) and ``run``: cohort, model step, decode
    results.py      a stream's first pass ends; its ``StreamResult``
    sessions.py     suspend, checkpoint, resume (session bytes)
    second_pass.py  attention rescoring: the jobs, the tick budget, a stream suspended mid-rescoring
"""

from oasr.engine.streaming.engine import StreamingEngine
from oasr.engine.streaming.records import StepOutput, StreamResult, TickStats

__all__ = ["StepOutput", "StreamResult", "StreamingEngine", "TickStats"]
