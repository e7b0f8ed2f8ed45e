"""The command line: the demo (the main job) and the bench harness run and say what they claim."""

import argparse
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from oasr.__main__ import main as oasr_main


@pytest.mark.parametrize("extra", [[], ["--kv-cache-dtype", "fp8_e4m3", "--eviction"]])
def test_demo_runs_and_reports(tmp_path, capsys, extra):
    plot = tmp_path / "demo.png"
    code = oasr_main(["engine-demo", "--streams", "6", "--check-sample", "2", "--quiet", "--plot", str(plot), *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "6 finished" in out and "memory by component" in out and "memory utilisation" in out
    assert "best token sequences" in out and "decoder states created" in out
    assert "-> OK" in out
    assert "demo: 1 torch thread(s)" in out
    assert "oasr engine-demo: 6 streams" in out  # it called itself "oasr demo", the speech demo's name
    assert plot.exists() and plot.stat().st_size > 10_000
    if extra:
        assert "fp8 saves" in out


def test_demo_rescore_prints_both_passes(capsys):
    code = oasr_main(["engine-demo", "--streams", "4", "--check-sample", "1", "--quiet", "--plot", "", "--rescore"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "attention rescoring" in out and "first pass [" in out and "rescored   [" in out and "-> OK" in out
    line = _refuses(capsys, ["engine-demo", "--streams", "2", "--quiet", "--plot", "", "--rescore", "--decoder",
                             "greedy"])
    assert "--rescore rescores the CTC beam search's n-best; it needs --decoder beam" in line


def test_bench_quick_section_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert oasr_main(["bench", "--quick", "--sections", "bookkeeping", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert rows and all(r["section"] == "bookkeeping" and r["ratio"] > 0 for r in rows)
    assert "ratio = reference_ms / fast_ms" in capsys.readouterr().out


def test_usage(capsys):
    assert oasr_main(["--help"]) == 0
    out = capsys.readouterr().out
    # every command's name stands apart from its description (transcribe and engine-demo ran into theirs)
    from oasr.__main__ import COMMANDS

    for name in COMMANDS:
        assert re.search(rf"^  {name}  +\S", out, re.MULTILINE), out
    assert max(map(len, out.splitlines())) <= 110
    # no command: the same list as a usage error, on stderr, exit 2 (it went to stdout)
    assert oasr_main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.endswith("python -m oasr: error: no command given\n")
    assert oasr_main(["nonsense"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "python -m oasr: error: unknown command 'nonsense'; choose from demo, transcribe, eval, train, bench, kernels, "
        "formats, engine-demo, serve (see --help)"
    ]


# ---- bad options: usage errors before any work ------------------------------------------------------------

def _refuses(capsys, argv: list[str]) -> str:
    """``argv`` ends in a usage error: exit status 2, one line on stderr, nothing on stdout; returns the line."""
    with pytest.raises(SystemExit) as exit_info:
        oasr_main(argv)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"python -m oasr {argv[0]}: error: ")
    assert captured.out == ""
    return lines[0]


def forbid(monkeypatch, module, *names: str) -> None:
    """Replace each ``module.<name>`` with a function that fails the test if anything calls it."""
    for name in names:
        def forbidden(*args, _name=name, **kwargs):
            raise AssertionError(f"{module.__name__}.{_name} was called before the options were checked")

        monkeypatch.setattr(module, name, forbidden)


@pytest.fixture
def no_demo_work(monkeypatch):
    """The demo must not build a model or an engine for a bad option."""
    from oasr.commands import demo

    forbid(monkeypatch, demo, "build", "StreamingConformer", "StreamingEngine")


@pytest.mark.parametrize("argv, expect", [
    (["--streams", "0"], "--streams must be >= 1, got 0"),
    (["--streams", "-3"], "--streams must be >= 1, got -3"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["--beam", "0"], "--beam must be >= 1"),
    (["--head-dim", "0"], "--head-dim must be >= 1, got 0"),
    (["--check-sample", "-1"], "--check-sample must be >= 0"),
    (["--suspend-every", "-1"], "--suspend-every must be >= 0"),
    (["--num-left-chunks", "-5"], "--num-left-chunks must be -1 (unlimited history) or >= 0, got -5"),
    (["--prefill", "--num-left-chunks", "-1"], "--prefill needs a bounded window"),
    (["--eviction", "--num-left-chunks", "-1"], "--eviction needs a bounded window"),
    (["--prefill", "--num-left-chunks", "0"], "prefills an empty window"),
    (["--device", "tpu"], "--device must be cpu or cuda[:N], got 'tpu'"),
    (["--device", "meta"], "--device must be cpu or cuda[:N], got 'meta'"),
    (["--plot", "/no/such/directory/demo.png"], "directory /no/such/directory does not exist"),
    (["--max-batch-size", "1000000"], "more than half of this cpu's"),
    (["--streams", "many"], "invalid int value: 'many'"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--plot", "foo.txt"], "--plot foo.txt: the plot is written as .png, .pdf, .svg"),
    (["--plot", "demo"], "give a path ending in one of them"),
    (["--decoder", "greedy", "--beam", "8"], "--beam 8 sizes the CTC prefix beam search; --decoder greedy has no beam"),
    (["--decoder", "greedy", "--beam", "0"], "--decoder greedy has no beam"),
])
def test_demo_bad_option_is_a_usage_error_before_any_work(capsys, no_demo_work, argv, expect):
    assert expect in _refuses(capsys, ["engine-demo", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a CUDA device here")
def test_demo_cuda_without_cuda_is_a_usage_error(capsys, no_demo_work):
    line = _refuses(capsys, ["engine-demo", "--device", "cuda"])
    assert "CPU build" in line or "no CUDA device" in line


def test_demo_plot_into_a_directory_is_refused(capsys, no_demo_work, tmp_path):
    assert "is a directory" in _refuses(capsys, ["engine-demo", "--plot", str(tmp_path)])


def test_demo_usage_error_exit_status_without_traceback():
    done = subprocess.run([sys.executable, "-m", "oasr", "engine-demo", "--streams", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    expect = "python -m oasr engine-demo: error: --streams must be >= 1, got 0 (see --help)"
    assert done.stderr.strip().splitlines() == [expect]


@pytest.fixture
def no_bench_work(monkeypatch):
    """The bench must not import (let alone run) a section for a bad option."""
    from oasr.commands import bench

    monkeypatch.setattr(bench, "importlib", types.SimpleNamespace(__name__="bench's importlib", import_module=None))
    forbid(monkeypatch, bench.importlib, "import_module")


@pytest.mark.parametrize("argv, expect", [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--sections", "bookkeeping,nope"], "unknown or no section(s) ['nope']"),
    (["--sections", ","], "unknown or no section(s)"),
    (["--device", "tpu"], "--device must be cpu or cuda[:N]"),
    (["--json", "/no/such/directory/rows.json"], "directory /no/such/directory does not exist"),
])
def test_bench_bad_option_is_a_usage_error_before_any_work(capsys, no_bench_work, argv, expect):
    assert expect in _refuses(capsys, ["bench", *argv])


@pytest.mark.parametrize("arch", ["foo", "sm_00", "sm_80,sm_9", ","])
def test_kernels_bad_arch_is_one_usage_error_before_any_compile(capsys, monkeypatch, arch):
    pytest.importorskip("cuda.bindings")
    from oasr.fast.kernels import nvrtc

    forbid(monkeypatch, nvrtc, "compile_family")
    line = _refuses(capsys, ["kernels", "--arch", arch])
    assert "--arch" in line


@pytest.mark.parametrize("command", ["demo", "engine-demo", "transcribe", "eval", "bench", "kernels",
                                     "serve"])
def test_help_shows_every_option_with_help_and_default(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        oasr_main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    usage, options = out.split("options:")
    names = re.findall(r"\[(--[a-z-]+)", usage)
    assert len(names) >= 4
    for name in names:
        assert re.search(rf"^\s+{name}\b", options, re.MULTILINE), f"{name} has no help line"
    assert options.count("(default") == len(names), options
    # no reStructuredText markup, no "(default: None)", a required option shows no default
    assert "``" not in out and "(default: None)" not in out


def test_help_texts_read_whole(capsys):
    from oasr.commands.bench import SECTIONS

    with pytest.raises(SystemExit):
        oasr_main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "finishes in seconds" not in out and "about 2 minutes" in out  # item 16: the time --quick takes
    assert "(default: all, in this order: " + ", ".join(SECTIONS) + ")" in out  # no name cut at a line end
    with pytest.raises(SystemExit):
        oasr_main(["train", "--help"])
    work = re.search(r"--work WORK(.*?)\n  --", capsys.readouterr().out, re.DOTALL).group(1)
    assert "default" not in work  # required: no default to show


def test_errors_name_the_command_as_invoked(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/oasr", "transcribe"])
    with pytest.raises(SystemExit):
        oasr_main(["transcribe", "/no/such/file.wav"])
    assert capsys.readouterr().err.startswith("oasr transcribe: error: /no/such/file.wav: no such file")
    assert oasr_main(["nonsense"]) == 2
    assert capsys.readouterr().err.startswith("oasr: error: unknown command 'nonsense'")


def test_kernels_without_the_cuda_extra_is_a_usage_error(capsys, monkeypatch):
    from oasr.commands import kernels

    def missing():
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(kernels, "supported_archs", missing)
    line = _refuses(capsys, ["kernels"])
    assert "install the `cuda` extra" in line


def test_demo_head_dim_follows_the_device():
    """The CPU demo keeps its small heads; on CUDA it takes head_dim 64, which the kernels tile
    (head_dim 16 there ended in 'no kernel for head_dim=16' on the first GPU run)."""
    from oasr.commands import demo

    args = argparse.Namespace(head_dim=None, device="cpu")
    assert demo.demo_head_dim(args) == 16
    args.device = "cuda"
    assert demo.demo_head_dim(args) == 64 and 64 in demo.CUDA_HEAD_DIMS
    args.head_dim = 128
    assert demo.demo_head_dim(args) == 128


def test_version_from_the_one_source(capsys):
    from pathlib import Path

    import oasr

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    assert oasr_main(["--version"]) == 0
    assert capsys.readouterr().out == f"oasr {oasr.__version__}\n"
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert project["scripts"]["oasr"] == "oasr.__main__:main"


def test_demo_threads_default_like_bench(capsys):
    defaults = {}
    for command in ("demo", "engine-demo", "bench"):
        with pytest.raises(SystemExit):
            oasr_main([command, "--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        defaults[command] = re.search(r"--threads THREADS .*?\(default: (\d+)\)", help_text).group(1)
    assert defaults == {"demo": "1", "engine-demo": "1", "bench": "1"}


def test_the_suite_runs_on_one_thread():
    """conftest pins torch to one thread (torch's default, one per core, made the suite ~60x slower here)."""
    assert torch.get_num_threads() == 1


def test_bench_json_without_path_is_json_alone_on_stdout(capsys):
    assert oasr_main(["bench", "--quick", "--sections", "bookkeeping", "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)  # nothing but the JSON
    assert rows and all(r["section"] == "bookkeeping" for r in rows)
    assert "== bookkeeping ==" in captured.err and "bench: 1 torch thread(s)" in captured.err


def test_kernels_sass_without_nvdisasm_is_refused_before_any_compile(capsys, monkeypatch):
    pytest.importorskip("cuda.bindings")
    from oasr.fast.kernels import nvrtc, sass

    def missing(name):
        raise RuntimeError(f"{name} not found")

    monkeypatch.setattr(sass, "find_tool", missing)
    forbid(monkeypatch, nvrtc, "compile_family")
    line = _refuses(capsys, ["kernels", "--arch", "sm_80", "--sass"])
    assert "--sass needs nvdisasm, which is not installed; pip install nvidia-cuda-nvdisasm" in line


def test_transcripts_label_the_shown_sequence_score():
    """With --rescore the shown tokens are the second pass's choice: their CTC score is theirs, not the
    first pass's best, and the heading says the sequences were rescored."""
    from oasr.commands import demo
    from oasr.ctc.config import CtcDecoderConfig, CtcHypothesis

    nbest = [CtcHypothesis([1, 2], -1.0, [0, 1]), CtcHypothesis([3], -2.5, [0])]
    result = types.SimpleNamespace(tokens=[3], nbest=nbest, first_pass=[1, 2])
    engine = types.SimpleNamespace(ctc=types.SimpleNamespace(num_created=1), ctc_config=CtcDecoderConfig(beam_size=4),
                                   rescore=True, result=lambda sid: result)
    lines = demo.transcripts(engine, [types.SimpleNamespace(stream_id="s000")])
    assert "attention-rescored n-best of the CTC prefix beam search" in lines[0]
    assert "CTC log p     -2.50" in lines[1] and "[3]" in lines[1]
    engine.rescore = False
    result.tokens = [1, 2]
    lines = demo.transcripts(engine, [types.SimpleNamespace(stream_id="s000")])
    assert "rescored" not in lines[0] and "CTC log p     -1.00" in lines[1]


# ---- run from the folder that holds a clone named ``oasr`` -----------------------------------------------------
# Python takes the clone (a folder named oasr without __init__.py) for a namespace package ``oasr`` when it
# is in the working directory, and an editable install's finder (appended to sys.meta_path) still supplies
# the submodules. This child reproduces that: cwd = a folder holding ``oasr`` -> this checkout, the usual
# path finder first, then a finder for this checkout's package standing in for the install's.
_CLONE_CHILD = r'''
import importlib.abc, importlib.util, os, runpy, sys
PACKAGE = sys.argv[1]
class Install(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "oasr":
            return None
        base = os.path.join(PACKAGE, *name.split(".")[1:])
        if os.path.isfile(os.path.join(base, "__init__.py")):
            return importlib.util.spec_from_file_location(name, os.path.join(base, "__init__.py"),
                                                          submodule_search_locations=[base])
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(name, base + ".py")
        return None
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()] + [Install()]
sys.path[:] = [""] + [p for p in sys.path if p and os.path.abspath(p) != os.path.dirname(PACKAGE)]
import oasr
assert getattr(oasr, "__file__", None) is None, "the clone was not taken for a namespace package"
from oasr.asr.checkpoint import default_model_path  # the library, as imported there: its assets
from oasr.asr.testset import load_testset
assert default_model_path().is_file(), default_model_path()
assert len(load_testset()) == 120 and load_testset()[0].path.is_file()
print("assets ok")
sys.argv = ["oasr", "--version"]  # and the command line
try:
    runpy.run_module("oasr", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
'''


def test_commands_run_from_the_folder_holding_a_clone_named_oasr(tmp_path):
    import oasr

    package = os.path.dirname(os.path.abspath(oasr.__file__))
    (tmp_path / "oasr").symlink_to(os.path.dirname(package), target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", _CLONE_CHILD, package], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["assets ok", f"oasr {oasr.__version__}"]


# ---- the speech commands' inputs: folders, channels, a test set's missing clip ---------------------------------
def test_eval_with_a_listed_clip_missing_is_one_line(capsys, tmp_path):
    (tmp_path / "transcripts.tsv").write_text("0000\thello\t{\"voice\": \"en\"}\n")
    line = _refuses(capsys, ["eval", "--testset", str(tmp_path)])
    assert "transcripts.tsv:1: clip '0000' is listed but" in line and "0000.flac does not exist" in line


def test_transcribe_a_folder_and_a_channel(capsys, tmp_path):
    import shutil

    import numpy as np
    import soundfile as sf

    from oasr.asr.testset import load_testset

    clips = load_testset(limit=2)
    folder = tmp_path / "clips"
    folder.mkdir()
    for clip in clips:
        shutil.copy(clip.path, folder / clip.path.name)
    (folder / "notes.txt").write_text("not audio, not listed")
    assert oasr_main(["transcribe", str(folder)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[0] for line in lines] == [str(folder / c.path.name) for c in clips]
    texts = [line.split(": ", 1)[1] for line in lines]
    # a stereo file of clip 0 (left) and silence (right): channel 0 is clip 0's text
    pcm, rate = sf.read(clips[0].path, dtype="float32")
    stereo = tmp_path / "stereo.wav"
    sf.write(stereo, np.stack([pcm, np.zeros_like(pcm)], 1), rate)
    assert oasr_main(["transcribe", "--channel", "0", str(stereo)]) == 0
    assert capsys.readouterr().out.strip() == texts[0]
    assert "channel 2 does not exist" in _refuses(capsys, ["transcribe", "--channel", "2", str(stereo)])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "a directory with no audio files in it" in _refuses(capsys, ["transcribe", str(empty)])


def test_transcribe_segments_of_a_long_file(capsys, tmp_path):
    import numpy as np
    import soundfile as sf

    from oasr.asr.audio import load_audio
    from oasr.asr.testset import load_testset

    clips = [load_audio(c.path) for c in load_testset(limit=3)]
    gap = np.zeros(3 * 16000, np.float32)  # leading silence and long pauses between the clips
    long = tmp_path / "long.wav"
    sf.write(long, np.concatenate([gap, clips[0], gap, clips[1], gap, gap, clips[2], gap]), 16000)
    for clip, i in zip(clips, range(3), strict=True):
        sf.write(tmp_path / f"clip{i}.wav", clip, 16000)
    assert oasr_main(["transcribe", *(str(tmp_path / f"clip{i}.wav") for i in range(3))]) == 0
    alone = [line.split(": ", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert oasr_main(["transcribe", "--segments", str(long)]) == 0
    lines = capsys.readouterr().out.splitlines()
    found = [re.fullmatch(r"\[\s*([\d.]+) s -\s*([\d.]+) s\] (.*)", line) for line in lines]
    assert all(found) and [m.group(3) for m in found] == alone, lines
    starts = [3.0, 6.0 + len(clips[0]) / 16000, 12.0 + (len(clips[0]) + len(clips[1])) / 16000]
    for m, start, clip in zip(found, starts, clips, strict=True):  # each segment lies on its clip's speech
        end = start + len(clip) / 16000
        assert start - 0.5 <= float(m.group(1)) < start + 0.5 and end - 0.5 < float(m.group(2)) <= end + 0.6
    assert "--segments and --partials" in _refuses(capsys, ["transcribe", "--segments", "--partials", str(long)])
