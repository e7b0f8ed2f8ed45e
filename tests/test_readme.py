"""The README's test command is the one CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python -m pip")]
    assert len(ci_lines) == 1
    assert ci_lines[0] in (ROOT / "README.md").read_text()


def test_the_two_commands_come_first_with_a_venv_line():
    text = (ROOT / "README.md").read_text()
    top = text[: text.index("## K/V page formats")]
    assert "python -m venv .venv" in top and "python -m oasr demo" in top
    ci_line = next(line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python -m pip"))
    assert ci_line in top
    assert "synthesized speech only" in top and "espeak-ng -v" in top and "--channel N" in top


def test_the_python_example_runs(tmp_path, monkeypatch):
    import re
    import shutil

    from oasr.asr.testset import load_testset

    (code,) = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert len(code.strip().splitlines()) <= 5 and "Recognizer()" in code
    clip = load_testset(limit=1)[0]
    shutil.copy(clip.path, tmp_path / "hello.flac")
    code = code.replace("hello.wav", "hello.flac")
    monkeypatch.chdir(tmp_path)
    printed = []
    exec(compile(code, "README.md [python block]", "exec"), {"print": printed.append})
    assert printed == [clip.text]
