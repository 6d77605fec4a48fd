"""benchmarks/real_model_report.py on generated runs: the tables' numbers and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
rmr = load_script("benchmarks/real_model_report.py")


def _write(run_dir: Path, rewards: list[float], step_s: float) -> Path:
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w", encoding="utf-8") as f:
        for step, reward in enumerate(rewards, 1):
            data = {"critic/score/mean": reward, "timing_s/step": step_s, "timing_s/gen": step_s / 4, "note": "x"}
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    return run_dir


def test_blocks_gain_threshold_and_ratio(tmp_path):
    base = rmr.load_run("base", _write(tmp_path / "a", [0.1] * 10 + [0.3] * 10 + [0.6] * 5, 2.0))
    fast = rmr.load_run("fast", _write(tmp_path / "b", [0.2] * 25, 1.0))
    assert rmr.blocks(base) == pytest.approx([0.1, 0.3, 0.6])  # a short last block counts
    assert rmr.time_to(base, 0.5) == (24, 48.0)  # the 5-step mean of steps 20-24 is 0.54
    assert rmr.time_to(fast, 0.5) is None
    text = rmr.report([base, fast], base, 0.5)
    assert "| base | 25 | 0.100 | 0.300 | 0.600 | +0.350 |" in text  # last 10: five 0.3, five 0.6
    assert "| fast | 1.00 | 0.50x | 1.0 | 0.25 |" in text  # step, ratio, first step, gen
    assert "step 24, 48 s" in text and "not reached" in text


def test_smoke_mode_runs_and_writes_the_png(tmp_path):
    png = tmp_path / "curves.png"
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "real_model_report.py"), "--smoke", "--png", str(png)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert "| candidate | 3.00 | 0.75x | 3.0 |" in out
    assert png.stat().st_size > 10_000


def test_start_up_steps_stay_out_of_the_medians_and_the_wall_clock_plot(tmp_path):
    d = _write(tmp_path / "w", [0.1, 0.2, 0.3, 0.4], 2.0)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[0]["data"]["timing_s/step"], rows[1]["data"]["timing_s/step"] = 60.0, 30.0  # compiles, first batch
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = rmr.load_run("w", d)
    assert run.median("timing_s/step", 3) == 2.0 and run.median("timing_s/step") == 16.0  # 60, 30, 2, 2
    assert run.median("timing_s/step", 99) == 16.0  # no step that late: every step
    text = rmr.report([run], run, 0.5)
    assert "| run (medians from step 3, s) |" in text and "| w | 2.00 | 1.00x | 60.0 |" in text
    assert "| w | 16.00 | 1.00x | 60.0 |" in rmr.report([run], run, 0.5, from_step=1)
    assert rmr.wall_clock(run) == [(60.0, 0.1), (90.0, 0.2), (92.0, 0.3), (94.0, 0.4)]
    png = tmp_path / "wall.png"
    assert rmr.main(["--run", f"w={d}", "--png", str(png), "--wall-clock"]) == 0 and png.stat().st_size > 10_000


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(SystemExit):
        rmr.main(["--run", "no-equals-sign"])
    with pytest.raises(SystemExit):
        rmr.main(["--run", f"x={_write(tmp_path / 'x', [0.1], 1.0)}", "--from-step", "0"])
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        rmr.main(["--run", f"x={tmp_path}"])


def test_steps_without_a_learning_signal_are_counted(tmp_path):
    """Steps with a mixed reward but all-zero advantages (the samples of every group identical) are counted."""
    d = tmp_path / "flat"
    d.mkdir()
    steps = [(0.375, 0.0, 0.0), (0.5, 1.62, -0.72), (0.0, 0.0, 0.0), (0.25, 0.0, 0.0), (1.0, 0.0, 0.0)]
    with (d / "metrics.jsonl").open("w", encoding="utf-8") as f:
        for step, (reward, hi, lo) in enumerate(steps, 1):
            data = {"critic/score/mean": reward, "critic/advantages/max": hi, "critic/advantages/min": lo,
                    "timing_s/step": 1.0}
            f.write(json.dumps({"step": step, "data": data}) + "\n")
    flat = rmr.load_run("flat", d)
    assert rmr.zero_signal_steps(flat) == (2, 3)  # steps 1 and 4; steps 3 and 5 had nothing to learn from
    assert "| flat | not reached | - | - | 2 of 3 |" in rmr.report([flat], flat, 0.9)
    plain = rmr.load_run("plain", _write(tmp_path / "p", [0.2] * 3, 1.0))
    assert rmr.zero_signal_steps(plain) is None


def test_checkpoint_saves_stay_out_of_the_step_column(tmp_path):
    """A run that saves at its last step (the remote recipe) compares with one that saves at none on its steps' work."""
    d = _write(tmp_path / "ckpt", [0.1] * 5, 2.0)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    rows[4]["data"]["timing_s/step"], rows[4]["data"]["timing_s/save_checkpoint"] = 6.0, 4.0
    rows[3]["data"]["timing_s/step"] = 3.0
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = rmr.load_run("ckpt", d)
    assert run.step_series()[-1] == (5, 2.0) and run.step_median(3) == 2.0  # 2, 3, 6 - 4
    assert run.median("timing_s/step", 3) == 3.0  # the raw series keeps the save
    assert "| ckpt | 2.00 | 1.00x | 2.0 |" in rmr.report([run], run, 0.5)


def test_the_gap_around_the_servers_seconds_is_split_per_phase(tmp_path):
    """verl's phase less the server's seconds, and its parts (driver + Ray hop, bridge, adapter, HTTP + wait), per
    step and then the median; phases without the server's seconds (a stock run) get no row."""
    d = _write(tmp_path / "remote", [0.1] * 4, 2.0)
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):  # step 1 is slow (a compile), the others differ a little
        extra = 10.0 if i == 0 else 0.01 * i
        row["data"].update({"timing_s/old_log_prob": 1.0 + extra, "timing_s/old_log_prob/worker": 0.9 + extra,
                            "timing_s/old_log_prob/adapter": 0.8 + extra, "timing_s/old_log_prob/http": 0.7 + extra,
                            "timing_s/old_log_prob/server": 0.4 + extra, "timing_s/update_weights": 0.1,
                            "timing_s/update_weights/http": 0.08, "timing_s/update_weights/server": 0.05})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stock = _write(tmp_path / "stock", [0.1] * 4, 3.0)
    text = rmr.report([rmr.load_run("remote", d), rmr.load_run("stock", stock)], rmr.load_run("stock", stock), 0.5,
                      from_step=2)
    assert "| remote | old_log_prob | 1.02 | 0.42 | 0.60 | 0.10 | 0.10 | 0.10 | 0.30 |" in text
    assert "| remote | update_weights | 0.10 | 0.05 | 0.05 | - | - | - | 0.03 |" in text
    assert "| stock | old_log_prob" not in text and "| remote | update_actor" not in text


@pytest.mark.parametrize("lines, peak", [
    (["memory.used [MiB]", "4819 MiB", "8339 MiB"], 8339),  # nvidia-smi with its header and units
    (["4819", "8339", "5511"], 8339),  # noheader, nounits (grpo_runs.sh before 2026-12-06)
    (["2026/12/06 05:09:58.201, 4819", "2026/12/06 05:09:58.401, 8339", "2026/12/06 05:09:58.601, 3703"], 8339),
])
def test_the_gpu_memory_peak_is_read_from_each_format_the_runners_wrote(tmp_path, lines, peak):
    d = _write(tmp_path / "m", [0.1, 0.2], 2.0)
    (d / "gpu_mem.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert rmr.load_run("m", d).gpu_mem_mib == peak
