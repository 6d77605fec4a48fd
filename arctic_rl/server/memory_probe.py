"""A diagnostic of the server process's GPU memory: where every byte is at the end of HTTP calls (off by default).

``python -m arctic_rl.server --memory-probe FILE`` (or ``$ARCTIC_RL_MEMORY_PROBE``) turns it on. On CUDA the
server then records, from its start, the Python stack of every live allocation of PyTorch's caching allocator
(``torch.cuda.memory._record_memory_history``, live state only, no event trace), and after an HTTP call ends it
appends one JSON line to FILE (at most one per path every ``min_interval_s``):

* ``in_use``: the device's memory in use, as the driver counts it (``mem_get_info``);
* ``reserved`` and ``allocated``: the caching allocator's totals, and ``pools``: the same per memory pool (the
  default pool is ``"0,0"``; vLLM's sleep-mode allocator and CUDA graphs have pools of their own);
* ``outside_allocator``: ``in_use`` minus ``reserved`` -- CUDA contexts, NCCL's and other libraries' own
  buffers; negative when a pool's blocks are unmapped (vLLM's sleeping memory stays reserved in PyTorch's view);
* ``sites``: the largest groups of live blocks by where they were allocated (the innermost frame outside
  PyTorch, and the innermost frame of this package when that is another), bytes and block count;
* ``cached_free``: reserved bytes of the default pool no live block covers (what ``empty_cache`` would return);
* ``streams``: the default pool's ``reserved`` and ``cached_free`` per CUDA stream (the allocator reuses a freed
  block only for the stream it was allocated on; ``"0"`` is the default stream, another number a stream's handle,
  such as ``--training-stream on``'s): whose cache the free bytes are.

The per-part reports of :mod:`arctic_rl.server.memory` say what the jobs hold; this says what the process holds,
which is what the GPU's other users see. Recording stacks slows every allocation a little: a run with the probe
is for finding memory, not for timing. On CPU the probe writes nothing. ``benchmarks/memory_probe_report.py``
reads the file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["PROBE_ENV", "MemoryProbe", "MemoryProbeMiddleware", "allocation_site", "summarize_snapshot"]

logger = logging.getLogger("arctic_rl.server")

#: the environment variable that gives ``--memory-probe``'s default
PROBE_ENV = "ARCTIC_RL_MEMORY_PROBE"
_DEFAULT_POOL = "0,0"
_TORCH_PARTS = ("/torch/", "\\torch\\")


def _pool_key(pool: Any) -> str:
    if isinstance(pool, (list, tuple)):
        return ",".join(str(int(p)) for p in pool)
    return str(pool) if pool is not None else _DEFAULT_POOL


def _frame_text(frame: dict[str, Any]) -> str:
    name = str(frame.get("filename", "?"))
    for marker in ("site-packages/", "dist-packages/"):
        if marker in name:
            name = name.split(marker, 1)[1]
    return f"{name}:{frame.get('line', '?')} {frame.get('name', '?')}"


def allocation_site(frames: list[dict[str, Any]]) -> str:
    """Where a block was allocated: the innermost frame outside PyTorch (frames run innermost first), and the
    innermost frame of ``arctic_rl`` when that is another one (``"?"`` without frames)."""
    outside = next((f for f in frames if not any(p in str(f.get("filename", "")) for p in _TORCH_PARTS)), None)
    ours = next((f for f in frames if "arctic_rl" in str(f.get("filename", ""))), None)
    if outside is None:
        return _frame_text(frames[0]) if frames else "?"
    site = _frame_text(outside)
    if ours is not None and ours is not outside:
        site += " <- " + _frame_text(ours)
    return site


def summarize_snapshot(snapshot: dict[str, Any], top: int = 15) -> dict[str, Any]:
    """Pools, allocation sites and the default pool's cached free bytes (in all and per stream) of a
    ``torch.cuda.memory._snapshot()``."""
    pools: dict[str, dict[str, int]] = {}
    sites: dict[str, list[int]] = {}
    cached_free = 0
    streams: dict[str, dict[str, int]] = {}
    for segment in snapshot.get("segments", []):
        pool = _pool_key(segment.get("segment_pool_id"))
        entry = pools.setdefault(pool, {"reserved": 0, "allocated": 0, "segments": 0})
        total = int(segment.get("total_size", 0))
        live = 0
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            size = int(block.get("size", 0))
            live += size
            frames = block.get("frames") or []
            key = f"[{pool}] {allocation_site(frames)}"
            hit = sites.setdefault(key, [0, 0])
            hit[0] += size
            hit[1] += 1
        entry["reserved"] += total
        entry["allocated"] += live
        entry["segments"] += 1
        if pool == _DEFAULT_POOL:
            cached_free += total - live
            stream = streams.setdefault(str(int(segment.get("stream", 0))), {"reserved": 0, "cached_free": 0})
            stream["reserved"] += total
            stream["cached_free"] += total - live
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {
        "reserved": sum(p["reserved"] for p in pools.values()),
        "allocated": sum(p["allocated"] for p in pools.values()),
        "pools": pools,
        "cached_free": cached_free,
        "streams": streams,
        "sites": [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]],
        "sites_left_out_bytes": sum(v[0] for _, v in ranked[top:]),
    }


class MemoryProbe:
    """Writes one JSON line per probe to ``path`` (see the module docstring); ``start()`` turns recording on."""

    def __init__(self, path: Path, min_interval_s: float = 2.0, top: int = 15,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self.min_interval_s = min_interval_s
        self.top = top
        self._clock = clock
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self.cuda = False

    def start(self) -> bool:
        """Record live allocations' stacks from now on (CUDA only); False where there is nothing to probe."""
        import torch

        self.cuda = torch.cuda.is_available()
        if not self.cuda:
            logger.warning("--memory-probe: no CUDA device; nothing is probed")
            return False
        torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("memory probe on: a line per call path every %.1f s at most, into %s", self.min_interval_s, self.path)
        return True

    def due(self, event: str) -> bool:
        """True (and the event's clock restarted) when ``event`` was last probed ``min_interval_s`` ago or never."""
        now = self._clock()
        with self._lock:
            if now - self._last.get(event, float("-inf")) < self.min_interval_s:
                return False
            self._last[event] = now
            return True

    def record(self, event: str, snapshot: dict[str, Any], in_use: int, total: int) -> dict[str, Any]:
        """The line for ``event``, appended to the file."""
        line = {"time": time.time(), "event": event, "in_use": in_use, "device_total": total,
                **summarize_snapshot(snapshot, self.top)}
        line["outside_allocator"] = in_use - line["reserved"]
        with self._lock, self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
        return line

    def probe(self, event: str) -> None:
        """Take the device's figures and the allocator's snapshot now, and record them (CUDA only)."""
        if not self.cuda:
            return
        import torch

        try:
            free, total = torch.cuda.mem_get_info()
            self.record(event, torch.cuda.memory._snapshot(), int(total - free), int(total))
        except Exception:  # a diagnostic must never fail a call
            logger.exception("memory probe failed at %s", event)


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class MemoryProbeMiddleware:
    """After each HTTP call (its answer sent), probes under the call's path, off the event loop."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], probe: MemoryProbe) -> None:
        self.app = app
        self.probe = probe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
        if scope["type"] == "http":
            event = f"{scope.get('method', '?')} {scope.get('path', '?')}"
            if self.probe.due(event):
                await asyncio.to_thread(self.probe.probe, event)
