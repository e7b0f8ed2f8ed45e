"""The README's test command is the one CI runs."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("python -m pip")]
    assert len(ci_lines) == 1
    assert ci_lines[0] in (ROOT / "README.md").read_text()
