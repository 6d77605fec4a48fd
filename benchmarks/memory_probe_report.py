"""Read the reference server's GPU memory probe (``--memory-probe FILE``): where the process's memory was, call by call.

Prints a markdown table, one row per probed call: seconds since the first, the call, the device's memory in use,
the caching allocator's reserve per pool (``0,0`` is the default pool; vLLM's sleep-mode allocator and CUDA
graphs have pools of their own), its cached free bytes (what ``empty_cache`` returns; then per CUDA stream where a
call ran on a stream besides the default one, as under ``--training-stream on``) and what the allocator does
not see (``outside``: CUDA contexts, NCCL and other libraries; negative while a pool's memory is unmapped, as vLLM's
is while it sleeps). Then the largest allocation sites at the rows with the most and the least memory in use.

    python benchmarks/memory_probe_report.py FILE [--sites 12] [--from-seconds 0]
    python benchmarks/memory_probe_report.py --smoke      # a file written by the probe from made-up snapshots

No GPU: it only reads the file (arctic_rl/server/memory_probe.py writes it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

GIB = float(1 << 30)


def load(path: Path) -> list[dict[str, Any]]:
    """The probe's lines, in file order (a line cut off by a killed server is skipped)."""
    rows = []
    for text in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:
            continue
    return rows


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def table(rows: list[dict[str, Any]], start: float) -> list[str]:
    pools = sorted({pool for row in rows for pool in row.get("pools", {})})
    streams = sorted({stream for row in rows for stream in row.get("streams", {})}, key=int)
    if streams == ["0"]:
        streams = []  # one stream: its cached free bytes are the total's
    names = {stream: "default stream" if stream == "0" else f"stream {i}" for i, stream in enumerate(streams)}
    head = ["s", "call", "in use", "reserved", *[f"pool {p}" for p in pools], "cached free",
            *[f"cached free, {names[s]}" for s in streams], "outside"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"{row['time'] - start:.1f}", row["event"], _gib(row["in_use"]), _gib(row["reserved"])]
        cells += [_gib(row.get("pools", {}).get(p, {}).get("reserved", 0)) for p in pools]
        cells.append(_gib(row.get("cached_free", 0)))
        cells += [_gib(row.get("streams", {}).get(s, {}).get("cached_free", 0)) for s in streams]
        cells.append(_gib(row.get("outside_allocator", 0)))
        out.append("| " + " | ".join(cells) + " |")
    return out


def sites(row: dict[str, Any], count: int) -> list[str]:
    listed = row.get("sites", [])
    out = [f"{_gib(site['bytes'])} GiB in {site['blocks']} blocks: {site['site']}" for site in listed[:count]]
    rest = row.get("sites_left_out_bytes", 0) + sum(site["bytes"] for site in listed[count:])
    if rest:
        out.append(f"{_gib(rest)} GiB at smaller sites")
    return out


def smoke_file(folder: Path) -> Path:
    """A probe file written by the server's own probe from two made-up snapshots (awake, then asleep)."""
    from arctic_rl.server.memory_probe import MemoryProbe

    gib = 1 << 30

    def segment(pool: tuple[int, int], size: int, where: str) -> dict[str, Any]:
        frames = [{"filename": f"/site-packages/{where}.py", "line": 1, "name": "f"}]
        return {"total_size": size, "segment_pool_id": pool,
                "blocks": [{"size": size, "state": "active_allocated", "frames": frames}]}

    snapshot = {"segments": [segment((0, 0), 2 * gib, "deepspeed/optimizer"), segment((0, 1), 4 * gib, "vllm/kv")]}
    path = folder / "probe.jsonl"
    probe = MemoryProbe(path)
    probe.record("POST /generate", snapshot, in_use=10 * gib, total=140 * gib)
    probe.record("POST /sleep-inference", snapshot, in_use=6 * gib, total=140 * gib)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", type=Path, nargs="?", help="the probe's file (--memory-probe FILE)")
    p.add_argument("--smoke", action="store_true", help="report a file the probe writes from made-up snapshots")
    p.add_argument("--sites", type=int, default=12, help="allocation sites to list per extreme row (default 12)")
    p.add_argument("--from-seconds", type=float, default=0.0, help="skip rows before this many seconds (start-up)")
    args = p.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as folder:
            return main([str(smoke_file(Path(folder))), "--sites", str(args.sites)])
    if args.file is None:
        p.error("FILE: the probe's file is required (or --smoke)")
    rows = load(args.file)
    if not rows:
        print(f"{args.file}: no probe lines", file=sys.stderr)
        return 1
    start = rows[0]["time"]
    rows = [row for row in rows if row["time"] - start >= args.from_seconds]
    if not rows:
        print(f"{args.file}: no probe lines after {args.from_seconds} s", file=sys.stderr)
        return 1
    print("\n".join(table(rows, start)))
    most = max(rows, key=lambda r: r["in_use"])
    least = min(rows, key=lambda r: r["in_use"])
    for label, row in (("most", most), ("least", least)):
        print(f"\n### the {label} in use: {_gib(row['in_use'])} GiB at {row['time'] - start:.1f} s, {row['event']}\n")
        print("\n".join(f"* {line}" for line in sites(row, args.sites)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
