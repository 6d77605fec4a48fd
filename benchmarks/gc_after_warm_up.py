"""What one full garbage collection costs the server's process once a compiled job has warmed up, frozen or not.

    python benchmarks/gc_after_warm_up.py            # a compiled (inductor) ZoRRO training job: ~2 min on 1 core
    python benchmarks/gc_after_warm_up.py --smoke    # eager, no compiles: a check of the script (run by the tests)

vLLM's sleep ends with ``gc.collect()``, and verl's old-log-prob ``/forward`` waits for the sampler's sleep
(``arctic_rl/server/jobs/sleep_gate.py``); Python's own oldest-generation collections walk the same objects. This
builds a real training job in this process (tiny Qwen3, DeepSpeed on CPU, ``torch_compile=layers``: inductor's C++
backend, so a C compiler must be there), runs its real warm-up (``arctic_rl/server/engines/warmup.py``), then times
a full collection -- the baseline, the collector as Python runs it -- and again after
:func:`arctic_rl.server.jobs.gc_freeze.freeze_long_lived`, what the server does after a warm-up
(``--gc-freeze on``). One torch thread. Target: a collection after the freeze takes <= 10% of the baseline's.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path


def _collect_s(repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="eager job (no compiles): seconds, a check of the script")
    p.add_argument("--repeat", type=int, default=5, help="collections timed per row (median)")
    args = p.parse_args(argv)

    import torch

    from arctic_rl.protocol import JobConfig, JobType
    from arctic_rl.server.engines import warmup
    from arctic_rl.server.engines.training import TrainingEngine
    from arctic_rl.server.jobs.gc_freeze import freeze_long_lived, thaw
    from arctic_rl.server.settings import ServerSettings
    from arctic_rl.tiny_models import build_tiny_model

    torch.set_num_threads(1)
    rows: list[tuple[str, int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", "qwen3", seed=0)
        rows.append(("before the job", len(gc.get_objects()), _collect_s(args.repeat)))
        settings = ServerSettings(checkpoint_root=root / "ck", warm_up="on",
                                  torch_compile="off" if args.smoke else "layers")
        config = JobConfig(model_name=str(model), job_type=JobType.TRAINING, checkpoint_path="train",
                           ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                           ds_worker_config={"zorro_train_enable": True, "rollout_n": 4})
        engine = TrainingEngine(config, settings, root / "job")
        try:
            rows.append(("job built", len(gc.get_objects()), _collect_s(args.repeat)))
            t0 = time.perf_counter()
            warmup.warm_up(engine, settings)
            warm_s = time.perf_counter() - t0
            baseline = _collect_s(args.repeat)
            rows.append((f"after its warm-up ({warm_s:.0f} s), as Python runs it", len(gc.get_objects()), baseline))
            freeze_long_lived("on", "by the benchmark")
            frozen = _collect_s(args.repeat)
            rows.append((f"after the freeze ({gc.get_freeze_count()} objects frozen)", len(gc.get_objects()), frozen))
        finally:
            thaw("on")
            engine.close()
    print(f"| moment (torch_compile={settings.torch_compile}) | objects | one full gc.collect(), median of "
          f"{args.repeat} |")
    print("|---|---|---|")
    for name, objects, seconds in rows:
        print(f"| {name} | {objects:,} | {seconds * 1000:.2f} ms |")
    ratio = frozen / baseline if baseline > 0 else 0.0
    verdict = "PASS" if ratio <= 0.1 else "FAIL"
    print(f"\nafter the freeze: {ratio:.3f}x the baseline's collection (target <= 0.1x): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
