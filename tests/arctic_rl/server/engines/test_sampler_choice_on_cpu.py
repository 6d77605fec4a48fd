"""The sampler choice and the CUDA fast loop, on a CPU machine (no vLLM here).

* ``--sampler auto`` falls back to the ``transformers`` sampler; ``--sampler vllm`` refuses to
  start and names what is missing; the job config's ``vllm_config`` is validated field by field;
* the CUDA loop (:mod:`arctic_rl.server.engines.fast_generation`: static cache, buckets, device-side
  stop tracking) gives the step-by-step loop's greedy tokens, log-probs and candidates, run here on
  CPU without compilation; the CPU sampler itself still runs the step-by-step loop, unchanged;
* stop strings applied after generation (the vLLM engine's way) cut where the step-by-step loop does.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
from arctic_rl.server.engines import create_engine
from arctic_rl.server.engines.fast_generation import generate_batch_static
from arctic_rl.server.engines.generation import Decoding, generate_batch
from arctic_rl.server.engines.sampler_choice import SamplerUnavailable, resolve_sampler
from arctic_rl.server.engines.sampling import SamplingEngine
from arctic_rl.server.engines.vllm_sampler import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    engine_options,
    prompt_seeds,
)
from arctic_rl.server.errors import BadRequest
from arctic_rl.server.settings import ServerSettings
from tests.support.scripts import REPO_ROOT

REPO = str(REPO_ROOT)


def test_auto_falls_back_to_transformers_on_cpu(tiny_model_dir, tmp_path, caplog):
    resolve_sampler.cache_clear()
    with caplog.at_level("INFO", logger="arctic_rl.server"):
        assert resolve_sampler("auto", "cpu") == "transformers"
    assert "auto chose transformers" in caplog.text and "--device cuda" in caplog.text
    config = JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING)
    engine = create_engine(config, ServerSettings(checkpoint_root=tmp_path), None)
    assert type(engine) is SamplingEngine
    with pytest.raises(ValueError, match="sampler: expected one of"):
        ServerSettings(sampler="fast", checkpoint_root=tmp_path)


def test_vllm_where_it_cannot_run_is_a_start_up_error(tmp_path):
    resolve_sampler.cache_clear()
    with pytest.raises(SamplerUnavailable, match=r"--sampler vllm: .*needs --device cuda"):
        resolve_sampler("vllm", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SamplerUnavailable, match="a visible CUDA device"):
            resolve_sampler("vllm", "cuda")
    proc = subprocess.run(
        [sys.executable, "-m", "arctic_rl.server", "--sampler", "vllm", "--port", "0",
         "--checkpoint-root", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--sampler vllm" in proc.stderr and "--device cuda" in proc.stderr


def test_vllm_config_is_validated_by_field():
    assert engine_options(None) == {"gpu_memory_utilization": DEFAULT_GPU_MEMORY_UTILIZATION}
    opts = engine_options({"gpu_memory_utilization": 0.3, "max_model_len": 2048, "tensor_parallel_size": 1,
                           "enforce_eager": True, "some_future_key": 3, "kv_cache_memory_bytes": 4 << 30})
    assert opts == {"gpu_memory_utilization": 0.3, "max_model_len": 2048, "enforce_eager": True,
                    "kv_cache_memory_bytes": 4 << 30}
    for bad, field in (({"gpu_memory_utilization": 1.5}, "vllm_config.gpu_memory_utilization"),
                       ({"gpu_memory_utilization": "half"}, "vllm_config.gpu_memory_utilization"),
                       ({"max_num_seqs": 0}, "vllm_config.max_num_seqs"),
                       ({"kv_cache_memory_bytes": 0}, "vllm_config.kv_cache_memory_bytes"),
                       ({"kv_cache_memory_bytes": "4G"}, "vllm_config.kv_cache_memory_bytes"),
                       ({"enforce_eager": 1}, "vllm_config.enforce_eager"),
                       ({"tensor_parallel_size": 2}, "vllm_config.tensor_parallel_size")):
        with pytest.raises(BadRequest) as info:
            engine_options(bad)
        assert info.value.field == field and info.value.received == next(iter(bad.values()))


def test_each_prompt_of_a_call_gets_its_own_vllm_seed():
    # no seed asked: every prompt samples from the engine's generator (copies of a prompt differ)
    assert prompt_seeds(None, 3, 8) == [None, None, None]
    # a seed: reproducible, and no two (prompt, sample) pairs share one (sample j of prompt i: seed + i*n + j)
    seeds = prompt_seeds(11, 16, 8)
    assert seeds == prompt_seeds(11, 16, 8) and seeds[:3] == [11, 19, 27]
    per_sample = {s + j for s in seeds for j in range(8)}
    assert len(per_sample) == 16 * 8
    assert prompt_seeds(2**62 - 1, 2, 1) == [2**62 - 1, 0]  # kept in vLLM's range


def _engine(tiny_model_dir, tmp_path) -> SamplingEngine:
    config = JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING)
    return SamplingEngine(config, ServerSettings(checkpoint_root=tmp_path))


def test_static_loop_matches_the_step_loop_greedy(tiny_model_dir, tmp_path):
    engine = _engine(tiny_model_dir, tmp_path)
    prompts = [list(engine.tokenizer("hello world")["input_ids"]), [5, 6, 7], list(range(10, 80))]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=2)
    free = generate_batch(engine.model, prompts[:1], params,
                          Decoding(torch.Generator(), set(), engine.pad_id, engine.tokenizer.decode))
    stop = {free[0].token_ids[5]}  # row 0 stops by the 6th token
    kw = {"stop_ids": stop | engine.eos_ids, "pad_id": engine.pad_id, "decode": engine.tokenizer.decode, "top_logprobs": 2}
    want = generate_batch(engine.model, prompts, params, Decoding(torch.Generator(), **kw))
    got = generate_batch_static(engine.model, prompts, params, Decoding(torch.Generator(), **kw), compile_step=False)
    assert [s.token_ids for s in got] == [s.token_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    assert want[0].finish_reason == "stop" and len(want[0].token_ids) <= 6
    assert [s.text for s in got] == [s.text for s in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-4, rtol=1e-4)
        assert [sorted(c) for c in g.candidates] == [sorted(c) for c in w.candidates]
        assert [sorted(v[1] for v in c.values()) for c in g.candidates] == [
            sorted(v[1] for v in c.values()) for c in w.candidates]


def test_cpu_sampler_keeps_the_step_loop(tiny_model_dir, tmp_path):
    """A seeded sampled request on CPU equals the step-by-step loop's samples for that seed."""
    engine = _engine(tiny_model_dir, tmp_path)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, n=2, logprobs=True)
    prompt = list(engine.tokenizer("abc")["input_ids"])
    results = engine.generate(GenerateRequest(prompts=[prompt]), params)
    gen = torch.Generator().manual_seed(7)
    want = generate_batch(engine.model, [prompt, prompt], params,
                          Decoding(gen, engine.eos_ids, engine.pad_id, engine.tokenizer.decode, top_logprobs=1))
    assert [r["token_ids"] for r in results] == [s.token_ids for s in want]
    got_lps = [[entry[str(t)]["logprob"] for t, entry in zip(r["token_ids"], r["logprobs"])] for r in results]
    assert got_lps == [s.logprobs for s in want]


def test_local_server_sampler_is_validated():
    from verl.remote_backend.errors import RemoteBackendConfigError
    from verl.workers.remote_client.arctic.arctic_config import ArcticConfig

    assert ArcticConfig.from_dict({}).server.local.sampler == "auto"
    assert ArcticConfig.from_dict({"server": {"local": {"sampler": "vllm"}}}).server.local.sampler == "vllm"
    with pytest.raises(RemoteBackendConfigError, match=r"server\.local\.sampler.*'fast'"):
        ArcticConfig.from_dict({"server": {"local": {"sampler": "fast"}}})
