"""The serve_load bench: N WebSocket clients against ``python -m oasr serve`` in a child process.

Structure and transcripts only, never timings: the quick grid's clients complete every stream with the
offline transcript, a server with fewer slots than clients refuses (503) and the run stops there, bad options
are refused before a server starts.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("websockets")

from oasr.asr.audio import load_audio  # noqa: E402
from oasr.asr.recognizer import Recognizer  # noqa: E402
from oasr.asr.testset import load_testset  # noqa: E402
from oasr.bench.serve_load import serve_load  # noqa: E402


def test_quick_grid_every_client_gets_the_offline_transcript():
    rows = serve_load("cpu", latency_budget_ms=1e6, start=8, max_clients=8, seconds=2.0, progress=None,
                      keep_attempts=True)  # the quick section's grid, with the transcripts kept
    assert [r["case"] for r in rows] == ["8 clients", "serve capacity"]
    row = rows[0]
    assert row["streams"] == row["completed"] == len(row["attempts"]) >= 8
    assert row["refused"] == 0 and row["errors"] == 0 and row["held"] and rows[1]["max_clients_held"] == 8
    assert row["peak_streams"] >= 1 and row["server_p99_ms"] is not None
    assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"] <= row["latency_max_ms"]
    assert row["final_p50_ms"] > 0 and row["wer"] < 0.2
    clips = load_testset()
    chosen = sorted({clip for _, clip, _ in row["attempts"]})
    offline = dict(zip(chosen, (t.text for t in Recognizer(max_streams=8).transcribe(
        [load_audio(clips[c].path) for c in chosen])), strict=True))
    assert [text for _, _, text in row["attempts"]] == [offline[clip] for _, clip, _ in row["attempts"]]


def test_a_server_with_fewer_slots_refuses_and_the_doubling_stops():
    rows = serve_load("cpu", latency_budget_ms=1e6, start=2, max_clients=8, seconds=1.0, progress=None,
                      max_streams=1, server_args=("--admit-timeout", "0.2"), stagger=0.0)
    assert [r["case"] for r in rows] == ["2 clients", "serve capacity"]
    assert rows[0]["refused"] >= 1 and rows[0]["completed"] >= 1 and not rows[0]["held"]
    assert rows[0]["completed"] + rows[0]["refused"] + rows[0]["errors"] >= rows[0]["streams"]
    assert rows[1]["max_clients_held"] == 0


@pytest.mark.parametrize("bad", [dict(start=0), dict(start=8, max_clients=4), dict(latency_budget_ms=0),
                                 dict(seconds=0), dict(max_streams=0)])
def test_bad_options_are_refused_before_a_server_starts(bad):
    with pytest.raises(ValueError, match="serve_load: need"):
        serve_load("cpu", **{"start": 2, "max_clients": 4, **bad})


def test_bench_lists_the_section_and_refuses_a_bad_budget(capsys):
    from oasr.commands.bench import SECTIONS, main

    assert SECTIONS["serve_load"][0] == "oasr.bench.serve_load"
    with pytest.raises(SystemExit) as exc:
        main(["--sections", "serve_load", "--latency-budget-ms", "-1"])
    assert exc.value.code == 2 and "--latency-budget-ms" in capsys.readouterr().err
