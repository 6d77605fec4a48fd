"""Serve the vendor's Arctic RL **v1** HTTP server (PyPI ``arctic-platform==0.1.2``) on 127.0.0.1, on CPU.

The FastAPI app is ``arctic_platform.rl.http_server.app`` from the unmodified PyPI wheel (installed
without its GPU dependencies by ``scripts/install.sh --test`` into ``<venv>/arctic-platform-v1``).
Every request runs vendor v1 code: the routes and their pydantic models, ``torch.load`` body decoding
and ``http_split_batch``, ``DeepSpeedWorker`` (initialize, forward_backward, forward_no_grad, step,
save_checkpoint, compute_log_probs, destroy) on a real DeepSpeed engine, ``run_pipeline``, the
``verl_grpo`` loss, the ZoRRO model patch and the metric combiners.

The GPU-, Ray- and vLLM-bound parts are substituted exactly as the shared vendor kit does for v2
(``run_vendor_server.py`` there; its docstring numbers them S1-S8, and this harness imports its
helpers rather than repeating them): in-process workers instead of Ray actors (S1), a fake CUDA
device query (S2), one shared gloo group (S3), the kit's CPU sampling pool for ``/generate`` (S4),
``/sync-weights`` over NCCL answering ``{"status": "ok"}`` without moving weights (S5),
``torch_adam`` (S6), a ``triton`` stand-in while the vendor package is imported (S7; v1 imports its
ZoRRO package from ``arctic_platform.rl.utils``, so the stand-in is present while the whole ``rl``
package is imported) and a CPU varlen attention for ``flash_attention_*`` (S8). v1 also imports two
ArcticInference modules the kit's stubs do not hold (``replica_pool``, ``weight_sync``); they are
given placeholder classes that are never called (the pool is S4's, the sender only serves the S5
route).

``--trace FILE`` appends one JSON line per exchange, written before the last byte of the answer is sent (a
client that has its answer finds the line): method, path, query, status and, after every
exchange, the training engine's ``global_steps`` (read from the in-process worker: the vendor's
``/step`` answer has no step count); for ``/fwd-bwd`` also the rows and response tokens of the call
and the metrics answered. Bodies are decoded with ``torch.load(weights_only=True)`` (no unpickling of
arbitrary objects).

usage: python vendor_v1_server.py --port P --v1-src DIR --kit DIR [--trace FILE]
Prints exactly one line ``READY <port>`` on stdout once it accepts connections.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.machinery
import importlib.util
import io
import json
import os
import sys
import types
from pathlib import Path
from typing import Any


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="TCP port on 127.0.0.1 (0: pick a free one)")
    ap.add_argument("--v1-src", required=True, help="directory holding the v1 arctic_platform package (0.1.2)")
    ap.add_argument("--kit", required=True, help="the shared vendor kit (run_vendor_server.py, arctic-inference-stubs)")
    ap.add_argument("--trace", default=None, help="append a JSON line per HTTP exchange to this file")
    return ap.parse_args()


def _load_kit(kit: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("vendor_kit_v2_harness", kit / "run_vendor_server.py")
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {kit / 'run_vendor_server.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _placeholder_inference_modules() -> None:
    """ArcticInference modules v1 imports beyond the kit's stubs: classes that are never called here."""

    def never(name: str) -> type:
        def init(self, *_a: Any, **_k: Any) -> None:
            raise RuntimeError(f"{name} is not available in the CPU harness")

        return type(name, (), {"__init__": init})

    for mod, cls in (("arctic_inference.server.replica_pool", "ReplicaPool"),
                     ("arctic_inference.server.weight_sync", None),
                     ("arctic_inference.server.weight_sync.schedule", "TransferSchedule"),
                     ("arctic_inference.server.weight_sync.sender", "WeightSender")):
        m = types.ModuleType(mod)
        m.__spec__ = importlib.machinery.ModuleSpec(mod, None, is_package=cls is None)
        if cls is not None:
            setattr(m, cls, never(cls))
        sys.modules[mod] = m


def _import_v1_with_triton_stand_in() -> types.ModuleType:
    """Import ``arctic_platform.rl.http_server``; without triton, with a stand-in present only meanwhile (S7)."""
    try:
        import triton
    except ImportError:
        pass
    else:
        return importlib.import_module("arctic_platform.rl.http_server")
    # what the vendor package imports besides triton, imported first so that none of it sees the stand-in
    for name in ("torch", "torch._dynamo", "deepspeed", "deepspeed.accelerator", "ray", "fastapi", "transformers",
                 "transformers.cache_utils", "transformers.modeling_outputs", "transformers.processing_utils",
                 "transformers.utils", "transformers.masking_utils", "transformers.modeling_flash_attention_utils"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    class _Kernel:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, _grid: Any) -> Any:
            def launch(*_a: Any, **_k: Any) -> None:
                raise RuntimeError(f"triton kernel {self.fn.__name__} launched, but triton is a stand-in here (S7)")

            return launch

    def jit(fn: Any = None, **_kw: Any) -> Any:
        return _Kernel(fn) if fn is not None else _Kernel

    tl = types.ModuleType("triton.language")
    tl.__spec__ = importlib.machinery.ModuleSpec("triton.language", None)
    tl.constexpr = type("constexpr", (), {})
    triton = types.ModuleType("triton")
    triton.__spec__ = importlib.machinery.ModuleSpec("triton", None, is_package=True)
    triton.jit, triton.language = jit, tl
    sys.modules["triton"], sys.modules["triton.language"] = triton, tl
    try:
        return importlib.import_module("arctic_platform.rl.http_server")
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


def build_app(kit_module: types.ModuleType) -> Any:
    """The vendor v1 app with the substitutions in place and ``app.state`` as its ``main()`` leaves it."""
    import torch
    import torch.distributed

    kit_module._process_group()  # S3
    _placeholder_inference_modules()
    hs = _import_v1_with_triton_stand_in()  # S7
    import arctic_platform.rl.deepspeed_worker as dw

    class _FakeDeviceProperties:
        uuid = "cpu-harness"

    torch.cuda.current_device = lambda: 0  # S2
    torch.cuda.get_device_properties = lambda _i: _FakeDeviceProperties()  # S2
    dw.primary_ip = lambda: "127.0.0.1"  # S2
    dw.dist = kit_module._DistKeepGroup(torch.distributed)  # S3
    vendor_worker = dw.DeepSpeedWorker.__ray_metadata__.modified_class
    training_config = vendor_worker.ds_training_config

    def ds_training_config(self: Any, job_config: dict, ds_config: dict, ds_worker_config: dict) -> dict:  # S6
        cfg = training_config(self, job_config, ds_config, ds_worker_config)
        cfg.setdefault("optimizer", {}).setdefault("params", {})["torch_adam"] = True
        return cfg

    vendor_worker.ds_training_config = ds_training_config
    shim = kit_module._LocalActorClass(vendor_worker)  # S1
    dw.DeepSpeedWorker = shim
    hs.DeepSpeedWorker = shim
    kit_module._register_cpu_flash_attention()  # S8
    dw.AutoModelForCausalLM = kit_module._AutoModelForCausalLMOnCPU  # S8

    async def _sync_weights_nccl(workers: Any, pool: Any) -> dict:  # S5
        return {"status": "ok"}

    hs._sync_weights_nccl = _sync_weights_nccl
    app = hs.app
    s = app.state  # as hs.main() sets it for --training-gpus 1 --sampling-gpus 1 --log-prob-gpus 1 (deepspeed)
    s.training_gpus, s.sampling_gpus, s.log_prob_gpus = 1, 1, 1
    s.log_prob_engine, s.colocate = "deepspeed", False
    s.placement, s.placement_group, s.n_bundles = hs.ColocatePlacement(), None, 0
    s.training_workers, s.log_prob_workers, s.log_prob_tokenizer = [], [], None
    s.sampling_pool, s.log_prob_pool = kit_module.FakePool(), None  # S4
    s.jobs, s.next_job_id = {}, 1
    s.weight_sync_ready, s.weight_sync_bucket_size = False, hs._WEIGHT_SYNC_BUCKET_SIZE
    return app


def _safe_load(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


class _Trace:
    """ASGI wrapper recording each exchange and the training engine's step count (observation only)."""

    def __init__(self, app: Any, path: str) -> None:
        self.app, self.path = app, path

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body: list[bytes] = []
        answer: list[bytes] = []
        status: dict[str, Any] = {}

        def record() -> None:
            if not status.get("recorded"):
                status["recorded"] = True
                self._record(scope, b"".join(body), b"".join(answer), status.get("code"))

        async def recv() -> dict:
            msg = await receive()
            if msg["type"] == "http.request":
                body.append(msg.get("body", b""))
            return msg

        async def snd(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            elif msg["type"] == "http.response.body":
                answer.append(msg.get("body", b""))
                if not msg.get("more_body", False):
                    record()  # before the client can see the end of the answer: a test reads the trace right after
            await send(msg)

        try:
            await self.app(scope, recv, snd)
        finally:
            record()

    def _global_steps(self) -> int | None:
        workers = getattr(self.app.state, "training_workers", None) or []
        engine = getattr(getattr(workers[0], "_obj", None), "engine", None) if workers else None
        return int(engine.global_steps) if engine is not None else None

    def _zorro_patched(self, scope: dict) -> bool | None:
        """Whether the vendor worker serving the call's job patched its model for ZoRRO at initialize."""
        query = dict(p.split("=", 1) for p in scope.get("query_string", b"").decode("latin-1").split("&") if "=" in p)
        info = self.app.state.jobs.get(int(query.get("job_id", -1)))
        if info is None:
            return None
        workers = self.app.state.training_workers if info["job_type"] == "training" else self.app.state.log_prob_workers
        worker = getattr(workers[0], "_obj", None) if workers else None
        return hasattr(worker, "dedup_actor_model_once_patcher") if worker is not None else None

    def _record(self, scope: dict, req: bytes, resp: bytes, code: int | None) -> None:
        rec: dict[str, Any] = {"method": scope["method"], "path": scope["path"],
                               "query": scope.get("query_string", b"").decode("latin-1"), "status": code}
        try:
            rec["global_steps"] = self._global_steps()
            if scope["path"] in ("/fwd-bwd", "/fwd-no-grad"):
                frame = _safe_load(req)
                batch, meta = frame["batch"], frame.get("meta") or {}
                rec["rows"] = int(batch["input_ids"].shape[0])
                rec["response_tokens"] = float(batch["response_mask"].sum()) if "response_mask" in batch else None
                rec["meta_keys"] = sorted(meta)
                rec["zorro_meta"] = bool(meta.get("zorro_train_enable", False))
                rec["post"] = list((frame.get("processing") or {}).get("post") or [])
                rec["zorro_patched"] = self._zorro_patched(scope)
                if code == 200:
                    out = _safe_load(resp)
                    rec["metrics"] = {k: float(v) for k, v in (out.get("metrics") or {}).items()
                                      if isinstance(v, (int, float)) or getattr(v, "numel", lambda: 0)() == 1}
            elif scope["path"] in ("/step", "/save-checkpoint") and code == 200:
                rec["answer"] = json.loads(resp)
        except Exception as exc:  # noqa: BLE001 - the trace never breaks a request
            rec["trace_error"] = f"{type(exc).__name__}: {exc}"
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")


def main() -> None:
    a = _args()
    sys.dont_write_bytecode = True  # keep the installed vendor package free of new __pycache__
    sys.stdout.flush()
    ready_fd = os.dup(1)
    os.dup2(2, 1)  # stdout carries only the READY line
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    kit, v1_src = Path(a.kit), Path(a.v1_src)
    if not (v1_src / "arctic_platform" / "rl" / "http_server.py").is_file():
        sys.exit(f"no arctic_platform/rl/http_server.py under {v1_src}")
    if not (kit / "run_vendor_server.py").is_file():
        sys.exit(f"no run_vendor_server.py in {kit}")
    sys.path[:0] = [str(v1_src.resolve()), str((kit / "arctic-inference-stubs").resolve())]
    kit_module = _load_kit(kit)
    app = build_app(kit_module)
    if a.trace:
        app = _Trace(app, a.trace)
    asyncio.run(kit_module._serve(app, a.port, ready_fd))


if __name__ == "__main__":
    main()
