"""Fresh-process half of tests/test_session_resume.py: resume sessions in a process that never saw them.

``python tests/session_child.py JOBS.json OUT.json``: each job names the format, the twin to resume on
and the session bytes (hex); a job of kind "rescoring" is a stream suspended mid-rescoring, resumed
and run to its rescored result (``rescored_record``). The engine here first hands slot 0 and the head
of the free list to a decoy (``hold_decoy``), so the stream comes back under other slot and block ids.
Writes, per job, the stream's slot and blocks once readmitted and its whole result (``result_record``).
"""

import json
import sys

from session_helpers import (
    SPLIT,
    features,
    hold_decoy,
    make_engine,
    make_model,
    recording_results,
    rescored,
    rescoring_engine,
    result_record,
)

SEEN = recording_results()  # the combined scores of every second pass run here


def resume_rescoring_job(job: dict) -> dict:
    """A stream suspended mid-rescoring: resumed here, its job runs to the end."""
    engine = rescoring_engine(make_model(), job["twin"])
    sid = engine.resume(bytes.fromhex(job["session"]))
    assert engine.status(sid) == "rescoring"
    engine.run()
    return rescored(engine, SEEN, sid)


def resume_job(job: dict) -> dict:
    if job.get("kind") == "rescoring":
        return resume_rescoring_job(job)
    engine = make_engine(make_model(job["fmt"]), job["twin"], job["fmt"])
    hold_decoy(engine)
    sid = engine.resume(bytes.fromhex(job["session"]))
    engine.push(sid, features()[SPLIT:])
    engine.end_stream(sid)
    engine.step()
    info = engine.att.describe(sid)
    record = result_record(engine.run()[sid])
    record.update(slot=info.slot, blocks=list(info.blocks))
    return record


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump([resume_job(job) for job in jobs], f)
