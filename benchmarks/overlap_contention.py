"""What slows a pass that runs while generation runs in the same process: the GPU, or Python's interpreter lock?

In asynchronous GRPO (docs/ASYNC.md) the reference server generates the next batch while the old log-prob pass of
this one runs, both in the server's one process. On an H100 that pass took 1.00-1.03 s on the server against 0.55 s
in sync mode, whether or not the training side ran on a CUDA stream of its own (benchmarks/RESULTS.md §2zf), while
the update, which starts once that generation has ended, took what it takes in sync mode. At 135M parameters a pass
is bound by the host launching its kernels, so two suspects remain: the GPU itself, and the GIL, which the sampler's
engine loop and the pass's thread share. This script times one pass -- a no-grad forward of a SmolLM2-135M-shaped
model (random weights) over the recipe's old log-prob batch, micro-batch by micro-batch, log-probs at the response
positions -- alone and beside each contender, started and warm before the timing:

* ``python-thread``: a thread of this process running pure Python (the GIL taken, no GPU work);
* ``python-process``: a process running pure Python (a CPU core taken, not the GIL): the control for the above;
* ``vllm-thread``: vLLM's engine in this process, as the server runs it (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  generating the recipe's batch over and over in a thread;
* ``vllm-core-process``: vLLM's default multiprocess mode: the engine core (scheduler, model runner) in a process of
  its own, the ``LLM.generate`` call and its output processing in a thread of this one -- what a server would run
  with its sampler out of process;
* ``vllm-process``: the engine and the loop in a process of its own (the GPU shared, the GIL not).

If ``vllm-thread`` slows the pass and ``vllm-process`` does not, the GIL is the cause and the sampler belongs out of
the server's process (``vllm-core-process`` says whether vLLM's own split is enough); if both slow it, the GPU is the
limit and a process split does not help. Each contender's own work while the passes ran is
printed too (loops of pure Python, generated tokens), since a contender that got starved says as much as the pass.

    python benchmarks/overlap_contention.py [--contenders python-thread,python-process,vllm-thread,vllm-process]
        [--rows 128 --micro-rows 16 --prompt-len 1600 --response-len 128] [--repeats 5] [--out DIR]
    python benchmarks/overlap_contention.py --cpu-smoke     # a tiny model on the CPU, the python contenders only

Prints a markdown table (the pass's median seconds and its ratio to the pass alone) and writes ``OUT/overlap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONTENDERS = ("python-thread", "python-process", "vllm-thread", "vllm-core-process", "vllm-process")
#: SmolLM2-135M's shape (the arithmetic recipe's model), and a tiny one for the CPU smoke run
SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def build_model(path: Path, shape: dict[str, int], dtype: str) -> Path:
    """A Llama-shaped causal LM with random weights (seed 0) saved at ``path`` (kept when it is there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(**shape, tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
        LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(str(path))
    return path


def prompt_ids(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


class Pass:
    """The timed pass: a no-grad forward over ``rows`` rows of prompt + response tokens, ``micro_rows`` at a time,
    the log-probs of the response tokens gathered (the head run only at those positions)."""

    def __init__(self, model_dir: Path, device: str, rows: int, micro_rows: int, prompt_len: int, response_len: int,
                 vocab: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").to(device).eval()
        ids = torch.tensor(prompt_ids(rows, prompt_len + response_len, vocab, seed=1), device=device)
        self.batches = list(ids.split(micro_rows))
        self.response_len = response_len

    def run(self) -> float:
        torch = self.torch
        t0 = time.perf_counter()
        with torch.no_grad():
            for ids in self.batches:
                hidden = self.model.model(input_ids=ids).last_hidden_state[:, -self.response_len - 1:-1]
                logits = self.model.lm_head(hidden).float()
                logits.log_softmax(-1).gather(-1, ids[:, -self.response_len:, None])
        if self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def spin_python(stop: threading.Event, counts: dict[str, int]) -> None:
    """Pure Python until ``stop``: holds the GIL as an engine loop's bookkeeping does, no device work."""
    loops = 0
    while not stop.is_set():
        total = 0
        for i in range(2000):
            total += i * i
        loops += 1
    counts["work"] = loops


def make_llm(model_dir: Path, max_model_len: int, core_process: bool = False) -> Any:
    """vLLM's engine with the options the server's vLLM sampler passes: all in this process, or (``core_process``)
    its engine core in a process of its own."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if core_process else "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # as the server: no FlashInfer JIT build on first use
    from vllm import LLM

    # the recipe's engine options (a KV cache of fixed size, so no memory profiling; 2 GiB holds the few-shot batch
    # with each prompt's blocks once: ~1.0 GiB, examples/common/kv_cache_bytes.py)
    return LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0, enable_sleep_mode=True,
               gpu_memory_utilization=0.1, kv_cache_memory_bytes=2 << 30, max_model_len=max_model_len,
               max_num_seqs=128, max_num_batched_tokens=8192, enable_chunked_prefill=True,
               enable_prefix_caching=True, logprobs_mode="processed_logprobs")


def generate_loop(llm: Any, prompts: list[list[int]], samples: int, response_len: int, stop: threading.Event,
                  counts: dict[str, int], ready: threading.Event) -> None:
    """The recipe's generation (each prompt ``samples`` times, ``response_len`` new tokens) over and over."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=samples, max_tokens=response_len, temperature=1.0, ignore_eos=True, logprobs=0,
                            detokenize=False)
    tokens = 0
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)  # warm
    ready.set()
    while not stop.is_set():
        out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens += sum(len(c.token_ids) for o in out for c in o.outputs)
    counts["work"] = tokens


class ThreadContender:
    """A contender in a thread of this process: pure Python (``llm`` None) or ``llm``'s generation loop."""

    def __init__(self, llm: Any, args: argparse.Namespace) -> None:
        self._stop, self._ready, self._counts = threading.Event(), threading.Event(), {}
        if llm is None:
            self._worker = threading.Thread(target=spin_python, args=(self._stop, self._counts))
            self._ready.set()
        else:
            prompts = prompt_ids(args.prompts, args.prompt_len, args.vocab)
            self._worker = threading.Thread(target=generate_loop, args=(
                llm, prompts, args.samples, args.response_len, self._stop, self._counts, self._ready))
        self._worker.start()

    def started(self) -> bool:
        """Wait until the contender is warm; False if its thread ended first (an error: its trace is printed)."""
        while not self._ready.wait(0.5):
            if not self._worker.is_alive():
                return False
        return True

    def stop(self) -> int:
        """Stop it; its work (Python loops, or generated tokens)."""
        self._stop.set()
        self._worker.join()
        return self._counts.get("work", 0)


def child(args: argparse.Namespace) -> int:
    """``--child KIND``: run one contender in this process until the stop file appears; write its work."""
    llm = None if args.child == "python" else make_llm(args.model_dir, args.prompt_len + args.response_len + 8)
    contender = ThreadContender(llm, args)
    if not contender.started():
        return 1
    (args.child_dir / "ready").touch()
    while not (args.child_dir / "stop").exists():
        time.sleep(0.05)
    (args.child_dir / "work.json").write_text(json.dumps({"work": contender.stop()}))
    return 0


def timed(bench: Pass, repeats: int) -> list[float]:
    bench.run()  # warm
    return [bench.run() for _ in range(repeats)]


def run_contender(name: str, bench: Pass, args: argparse.Namespace, llm_holder: dict[str, Any]) -> dict[str, Any]:
    """Start ``name``, wait until it is warm, time the pass ``repeats`` times beside it, stop it."""
    t0 = time.perf_counter()
    if name.endswith("-process"):
        folder = Path(tempfile.mkdtemp(prefix="overlap-"))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name.split("-")[0], "--child-dir",
               str(folder), "--model-dir", str(args.model_dir), "--prompt-len", str(args.prompt_len),
               "--response-len", str(args.response_len), "--prompts", str(args.prompts), "--samples",
               str(args.samples), "--vocab", str(args.vocab)]
        proc = subprocess.Popen(cmd, cwd=REPO)
        while not (folder / "ready").exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: the contender process exited ({proc.returncode}) before it was ready")
            time.sleep(0.2)
        started = time.perf_counter()
        times = timed(bench, args.repeats)
        (folder / "stop").touch()
        proc.wait(timeout=600)
        work = json.loads((folder / "work.json").read_text())["work"]
    else:
        if name != "python-thread" and name not in llm_holder:
            llm_holder[name] = make_llm(args.model_dir, args.prompt_len + args.response_len + 8,
                                        core_process=name == "vllm-core-process")
        contender = ThreadContender(llm_holder.get(name), args)
        if not contender.started():
            raise RuntimeError(f"{name}: the contender's thread ended before it was ready")
        started = time.perf_counter()
        times = timed(bench, args.repeats)
        work = contender.stop()
    seconds = time.perf_counter() - started
    return {"contender": name, "pass_s": times, "median_s": statistics.median(times),
            "contender_work_per_s": work / seconds, "start_s": started - t0}


def table(rows: list[dict[str, Any]]) -> str:
    alone = rows[0]["median_s"]
    out = ["| beside | pass, median s (of each) | × alone | the contender's work per second |", "|---|---|---|---|"]
    for row in rows:
        each = ", ".join(f"{t:.3f}" for t in row["pass_s"])
        work = "-" if row["contender"] == "alone" else f"{row['contender_work_per_s']:,.0f}"
        out.append(f"| {row['contender']} | {row['median_s']:.3f} ({each}) | {row['median_s'] / alone:.2f} | {work} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}")
    p.add_argument("--rows", type=int, default=128, help="rows of the pass (the recipe's 16 prompts x 8 samples)")
    p.add_argument("--micro-rows", type=int, default=16, help="rows per forward of the pass")
    p.add_argument("--prompt-len", type=int, default=1600, help="prompt tokens (the few-shot recipe's bound)")
    p.add_argument("--response-len", type=int, default=128, help="response tokens")
    p.add_argument("--prompts", type=int, default=16, help="prompts the generation contender samples from")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (vLLM's n)")
    p.add_argument("--repeats", type=int, default=5, help="timed passes per contender (after one warm pass)")
    p.add_argument("--out", type=Path, default=None, help="folder for overlap.json (and the model)")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU, the python contenders only")
    p.add_argument("--child", choices=("python", "vllm"), help=argparse.SUPPRESS)
    p.add_argument("--child-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=SMOLLM2["vocab_size"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        p.error(f"--contenders: expected names of {list(CONTENDERS)}, got {unknown}")
    out = args.out or Path(tempfile.mkdtemp(prefix="overlap-out-"))
    out.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    if args.cpu_smoke:
        device, shape, dtype = "cpu", TINY, "float32"
        args.rows, args.micro_rows, args.prompt_len, args.response_len, args.repeats = 4, 2, 24, 8, 3
        contenders = [c for c in contenders if c.startswith("python")]
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: run on a GPU, or pass --cpu-smoke")
        device, shape, dtype = "cuda", SMOLLM2, "bfloat16"
    args.vocab = shape["vocab_size"]
    args.model_dir = build_model(out / f"model-{shape['hidden_size']}", shape, dtype)
    bench = Pass(args.model_dir, device, args.rows, args.micro_rows, args.prompt_len, args.response_len, args.vocab)
    rows = [{"contender": "alone", "pass_s": timed(bench, args.repeats), "contender_work_per_s": 0.0}]
    rows[0]["median_s"] = statistics.median(rows[0]["pass_s"])
    llm_holder: dict[str, Any] = {}
    for name in contenders:
        print(f"[overlap] beside {name} ...", file=sys.stderr, flush=True)
        rows.append(run_contender(name, bench, args, llm_holder))
    report = table(rows)
    print(report)
    (out / "overlap.json").write_text(json.dumps({"device": device, "rows": rows, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
