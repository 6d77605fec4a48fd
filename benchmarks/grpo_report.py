"""The table of ``gpu_grpo_loop.py``: per-phase seconds of the loop through the adapter against the bare components.

    python benchmarks/grpo_report.py DIR/loop_zorro_off.json DIR/loop_zorro_on.json DIR/bare.json

Loop figures are medians over the timed steps (warm-up steps excluded); ``total`` is the median
wall time of a whole step. The bare sum is the issue's definition, bare ``vllm.LLM.generate`` +
bare forward-backward and optimizer step; a second sum adds the bare forward (the old-log-prob pass,
which a GRPO step also needs). Overhead = loop total / bare sum - 1 (goal: <= 25%).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

__all__ = ["print_report", "report_lines"]

PHASES = ("generate", "batch", "old_log_prob", "update", "weight_sync")
GOAL = 0.25


def _load(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    loops, bare = [], None
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such results file")
        record = json.loads(path.read_text())
        if path.name.startswith("bare"):
            bare = record
        else:
            loops.append(record)
    return loops, bare


def _med(steps: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def report_lines(paths: list[Path]) -> list[str]:
    """Markdown lines: one column per loop setting, one per bare component."""
    loops, bare = _load(paths)
    lines: list[str] = []
    ok_bare = bare is not None and "error" not in bare
    if bare is not None and not ok_bare:
        lines.append(f"bare components failed: {bare['error'][:500]}")
    for rec in loops:
        if rec.get("error") or not rec.get("steps"):
            lines.append(f"loop zorro={'on' if rec.get('zorro') else 'off'}: no timed step "
                         f"({rec.get('error', 'none ran')[:500]})")
    loops = [r for r in loops if r.get("steps")]
    if not loops:
        return lines
    shape = loops[0]["shape"]
    lines.append(f"{shape['prompts']} prompts x n={shape['n']}, {shape['prompt_len']}-token prompts, "
                 f"{shape['response_len']}-token responses, micro-batch {shape['micro']} rows, device "
                 f"{shape['device']}, sampler {shape['sampler']}; median of {len(loops[0]['steps'])} step(s) "
                 f"after {len(loops[0]['warmup'])} warm-up")
    names = [f"loop, ZoRRO {'on' if r['zorro'] else 'off'}" for r in loops]
    lines.append("| phase (s) | " + " | ".join(names) + " | bare |")
    lines.append("| --- |" + " --- |" * (len(names) + 1))
    bare_of = {"generate": "generate", "old_log_prob": "forward", "update": "fwd_bwd_step"}
    for phase in PHASES:
        cells = [f"{_med(r['steps'], phase):.2f}" for r in loops]
        b = f"{bare[bare_of[phase]]['s']:.2f}" if ok_bare and phase in bare_of else "-"
        lines.append(f"| {phase} | " + " | ".join(cells) + f" | {b} |")
    totals = [_med(r["steps"], "total") for r in loops]
    lines.append("| **total per step** | " + " | ".join(f"**{t:.2f}**" for t in totals) + " | |")
    lines.append("| slowest step | " + " | ".join(f"{max(s['total'] for s in r['steps']):.2f}" for r in loops)
                 + " | |")
    if ok_bare:
        gen, fwd, fb = bare["generate"]["s"], bare["forward"]["s"], bare["fwd_bwd_step"]["s"]
        for label, base in (("bare generate + fwd-bwd/step", gen + fb), ("... + bare forward", gen + fwd + fb)):
            over = [t / base - 1 for t in totals]
            lines.append(f"| overhead vs {label} ({base:.2f} s) | "
                         + " | ".join(f"{o:+.1%} {'PASS' if o <= GOAL else 'FAIL'}" for o in over) + " | |")
        rows = [("generate", gen), ("old_log_prob", fwd), ("update", fb)]
        lines.append("| loop / bare, per phase | " + " | ".join(
            ", ".join(f"{p} {_med(r['steps'], p) / b:.2f}x" for p, b in rows) for r in loops) + " | |")
    for r in loops:
        if r.get("gpu_used_gib"):
            lines.append(f"GPU memory in use after each step, ZoRRO {'on' if r['zorro'] else 'off'}: "
                         f"{min(r['gpu_used_gib']):.1f}-{max(r['gpu_used_gib']):.1f} GiB; "
                         f"server + jobs start {r['start_s']:.0f} s; warm-up step "
                         + ", ".join(f"{w['total']:.1f} s" for w in r["warmup"]))
    if ok_bare and "init_s" in bare["generate"]:
        lines.append(f"bare vLLM engine start {bare['generate']['init_s']:.0f} s, "
                     f"{bare['generate'].get('tokens', 0)} tokens per generate; bare DeepSpeed peak "
                     f"{bare.get('peak_gib', 0):.1f} GiB")
    return lines


def print_report(paths: list[Path]) -> None:
    """Print :func:`report_lines` of ``paths``."""
    print("\n".join(report_lines([Path(p) for p in paths])), flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: grpo_report.py RESULTS.json [...]")
    print_report([Path(a) for a in sys.argv[1:]])
