"""The README is short, says what the project is on its first screen, has two commands that are one command
each, and quotes only figures that the docs or benchmarks/RESULTS.md state (each figure lives there; the README
points at it). The /generate-against-vLLM figures are stated with the answer format each belongs to."""

from __future__ import annotations

import pathlib
import re
import subprocess

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
SOURCES = sorted([*(REPO_ROOT / "docs").glob("*.md"), REPO_ROOT / "benchmarks" / "RESULTS.md"])
FENCE = re.compile(r"^(```|~~~)")
# Quoted figures: durations, ratios and ranges, rewards and loads with decimals, test counts. Not versions
# (2.13.0, ==, >=), dates or times of day.
FIGURE = re.compile(
    r"(?<![\w.=<>~-])(?<!≥ )(?<!Python )(?:"
    r"\d+ min \d+ s"                                      # 17 min 12 s
    r"|\d+\.\d+(?:\s*[–-]\s*\d+\.\d+)?\s*[×x]"            # 0.76×, 0.95-1.11×
    r"|\d+\.\d+\s*[–-]\s*\d+\.\d+(?![\d.:])"              # 2.6-3.7
    r"|\d+\.\d{2,3}(?![\d.:])"                            # 0.476
    r"|\d{1,3}(?:,\d{3})+ (?:passed|skipped)"             # 1,132 passed
    r")"
)


def _prose(text: str) -> str:
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def _normal(text: str) -> str:
    text = text.replace("–", "-").replace("×", "x").replace("\u2009", " ")
    return re.sub(r"\s*-\s*", "-", text)


def readme_figures() -> list[str]:
    return FIGURE.findall(_prose(README.read_text()))


def test_the_readme_is_a_five_minute_read_that_says_what_the_project_is():
    text = README.read_text()
    assert len(text.split()) <= 1300, f"{len(text.split())} words"
    first_screen = text.split("\n## ", 1)[0]  # everything before the first section
    assert len(first_screen.splitlines()) <= 24
    for term in ("remote backend", "**Arctic RL**", "**The reference server**", "**ZoRRO**"):
        assert term in first_screen, term
    # each of the three in one plain sentence: a bullet line ending with a full stop, before the commands
    for term in ("Arctic RL", "The reference server", "ZoRRO"):
        (bullet,) = [b.strip() for b in re.split(r"\n- ", first_screen) if b.startswith(f"**{term}**")]
        assert bullet.rstrip().endswith(".") and bullet.count(". ") <= 1, bullet


def _fenced_after(marker: str) -> list[str]:
    text = README.read_text()
    block = text.split(marker, 1)[1].split("```", 2)[1]
    return [line for line in block.splitlines()[1:] if line.strip()]


@pytest.mark.parametrize("marker", ["<!-- main-command -->", "<!-- test-command -->"])
def test_each_of_the_two_commands_is_one_command(marker):
    (line,) = _fenced_after(marker)
    assert not re.search(r"&&|\|\||;|\|", line), line
    script = REPO_ROOT / line.split()[1]
    assert line.split()[0] == "bash" and script.is_file(), line


def test_ci_extracts_the_test_command_and_it_installs_lints_and_runs_pytest():
    awk = ("/<!-- test-command -->/{found=1; next} found && /^```/{if (inblock) exit; inblock=1; next} "
           "found && inblock {print; exit}")
    assert awk in (REPO_ROOT / ".ci" / "run").read_text()  # the extraction tested here is CI's
    line = subprocess.run(["awk", awk, str(README)], capture_output=True, text=True, check=True).stdout.strip()
    assert line == "bash scripts/test.sh"
    steps = [s for s in (REPO_ROOT / "scripts" / "test.sh").read_text().splitlines() if s and not s.startswith("#")]
    assert steps[-3:] == ["bash scripts/install.sh --test", ".venv/bin/ruff check .",
                          'exec .venv/bin/python -m pytest -n 2 --dist loadscope "$@"']
    quick = (REPO_ROOT / "scripts" / "quickstart.sh").read_text()
    assert "bash scripts/install.sh\n" in quick and "examples/grpo/run_reverse_text_grpo_arl_local.sh" in quick


def test_the_test_commands_paragraph_states_one_measured_time_and_its_conditions():
    text = _prose(README.read_text())
    paragraph = text.split("<!-- test-command -->", 1)[1].split("\n\n")[1]
    times = re.findall(r"\d+ min \d+ s", paragraph)
    assert len(times) == 2, times  # one run: its whole time, and its pytest part
    development = (REPO_ROOT / "docs" / "DEVELOPMENT.md").read_text()
    quoted = [line for line in development.splitlines() if "(the README's)" in line]
    assert len(quoted) == 1 and times[0] in quoted[0] and times[1] in quoted[0], (times, quoted)  # the table's row
    assert "2-core" in paragraph and "fresh clone" in paragraph and "nothing else running" in paragraph


def test_every_figure_the_readme_quotes_is_stated_in_the_docs_or_results():
    figures = readme_figures()
    assert len(figures) >= 5, figures  # the pattern finds them
    sources = _normal("\n".join(p.read_text() for p in SOURCES))
    missing = [f for f in figures if _normal(f) not in sources]
    assert not missing, f"README figures stated nowhere in docs/ or benchmarks/RESULTS.md: {missing}"


def test_the_generate_figures_name_their_answer_format():
    text = _normal((REPO_ROOT / "docs" / "PERFORMANCE.md").read_text())
    compact = [line for line in text.splitlines() if "0.95-1.11x" in line]
    vendor = [line for line in text.splitlines() if "0.63-0.82x" in line]
    assert compact and all("compact" in line for line in compact), compact
    assert vendor and all("vendor" in line for line in vendor), vendor
    assert "0.95" not in _prose(README.read_text()) and "0.63" not in _prose(README.read_text())


def test_the_figure_pattern_finds_figures_and_skips_versions():
    text = "took 17 min 12 s, 0.76× stock, 0.95–1.11×, load 2.6-3.7, reward 0.476; 1,132 passed; torch==2.13.0, Python ≥ 3.10"
    assert FIGURE.findall(text) == ["17 min 12 s", "0.76×", "0.95–1.11×", "2.6-3.7", "0.476", "1,132 passed"]
