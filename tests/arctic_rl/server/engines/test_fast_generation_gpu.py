"""The transformers sampler's CUDA loop (static cache, CUDA-graph decode step, buckets) on a GPU.

Against the step-by-step loop on the same fp32 model: the same greedy tokens, log-probs and
candidates, also on a second call of the same bucket (the compiled step and its cache are reused)
and on a request of another bucket; and the server's ``SamplingEngine`` on CUDA takes this loop.
Skipped without a CUDA device (``python -m pytest tests/arctic_rl/server/engines/test_fast_generation_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.protocol import GenerateRequest, JobConfig, JobType, SamplingParams
from arctic_rl.server.engines import fast_generation
from arctic_rl.server.engines.generation import Decoding, generate_batch
from arctic_rl.server.settings import ServerSettings

pytestmark = pytest.mark.gpu


def test_cuda_loop_matches_the_step_loop(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arctic_rl.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m", "qwen3", seed=1, hidden_size=128, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=3)
    for rows, width in ((5, 12), (5, 12), (17, 70)):
        prompts = [[(7 * i + j) % 90 + 3 for j in range(width - i % 3)] for i in range(rows)]
        kw = {"stop_ids": {2}, "pad_id": 0, "decode": tok.decode, "top_logprobs": 3}
        want = generate_batch(model, prompts, params, Decoding(torch.Generator("cuda"), **kw))
        got = fast_generation.generate_batch_static(model, prompts, params, Decoding(torch.Generator("cuda"), **kw))
        assert [s.token_ids for s in got] == [s.token_ids for s in want]
        assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.logprobs, w.logprobs, atol=2e-4, rtol=1e-4)
            assert [sorted(c) for c in g.candidates] == [sorted(c) for c in w.candidates]
    buckets = sorted(k[1:] for k in fast_generation._CACHES if k[0] == id(model))
    assert buckets == [(8, 256), (32, 256)]  # the first bucket's cache was reused by the second call


def test_sampling_engine_takes_the_cuda_loop(tiny_model_dir, tmp_path, monkeypatch):
    from arctic_rl.server.engines.sampling import SamplingEngine

    calls = []
    real = fast_generation.generate_batch_static

    def counting(*args, **kwargs):
        calls.append(len(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr("arctic_rl.server.engines.sampling.generate_batch_static", counting)
    engine = SamplingEngine(JobConfig(model_name=str(tiny_model_dir), job_type=JobType.SAMPLING),
                            ServerSettings(device="cuda", sampler="transformers", checkpoint_root=tmp_path))
    out = engine.generate(GenerateRequest(prompts=[[5, 6, 7]]), SamplingParams(n=3, max_tokens=8, seed=3,
                                                                             ignore_eos=True, logprobs=True))
    assert calls == [3] and [r["generation_len"] for r in out] == [8, 8, 8]
    engine.generate(GenerateRequest(prompts=[[5, 6, 7]]), SamplingParams(max_tokens=8, stop=["zz"]))
    assert calls == [3]  # stop strings take the step-by-step loop
