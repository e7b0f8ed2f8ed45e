"""The command line: the demo (the main job) and the bench harness run and say what they claim."""

import json

import pytest

from oasr.__main__ import main as oasr_main


@pytest.mark.parametrize("extra", [[], ["--kv-cache-dtype", "fp8_e4m3", "--eviction"]])
def test_demo_runs_and_reports(tmp_path, capsys, extra):
    plot = tmp_path / "demo.png"
    code = oasr_main(["demo", "--streams", "6", "--check-sample", "2", "--quiet", "--plot", str(plot), *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "6 finished" in out and "memory by component" in out and "memory utilisation" in out
    assert "best token sequences" in out and "decoder states created" in out
    assert "-> OK" in out
    assert plot.exists() and plot.stat().st_size > 10_000
    if extra:
        assert "fp8 saves" in out


def test_bench_quick_section_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert oasr_main(["bench", "--quick", "--sections", "bookkeeping", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert rows and all(r["section"] == "bookkeeping" and r["ratio"] > 0 for r in rows)
    assert "ratio = reference_ms / fast_ms" in capsys.readouterr().out


def test_usage():
    assert oasr_main(["--help"]) == 0
    assert oasr_main(["nonsense"]) == 2
