"""The reference server's ``--torch-compile`` (``ServerSettings.torch_compile``).

``auto`` (the default) resolves to whole decoder layers on CUDA when a probe compile works there
and to ``off`` on CPU; ``compile_model`` picks whole decoder layers (``layers``) or only their
norms and MLPs (``modules``). The compiled model must give the eager model's log-probs and
gradients on the plain pass and on ZoRRO's two passes, and ZoRRO must not make each layer compile
its own graph. Compilation runs inductor on CPU, so the numerical tests are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from arctic_rl.server.__main__ import parse_args
from arctic_rl.server.compute.token_logprobs import response_logprobs
from arctic_rl.server.engines import common
from arctic_rl.server.engines.common import compile_model, resolve_compile_mode
from arctic_rl.server.settings import TORCH_COMPILE_MODES, ServerSettings
from arctic_rl.tiny_models import tiny_config

LAYERS = 2


def _model(seed: int = 0, layers: int = LAYERS):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config("qwen3", vocab_size=64, hidden_size=32, num_layers=layers, num_heads=4, num_kv_heads=2)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def test_setting_and_flag_accept_only_known_modes():
    assert TORCH_COMPILE_MODES == ("auto", "off", "layers", "modules")
    assert ServerSettings().torch_compile == "auto"
    assert ServerSettings(torch_compile="modules").torch_compile == "modules"
    with pytest.raises(
        ValueError, match=r"torch_compile: expected one of \['auto', 'off', 'layers', 'modules'\], got 'fast'"
    ):
        ServerSettings(torch_compile="fast")
    assert parse_args([]).torch_compile == "auto"
    assert parse_args(["--torch-compile", "layers"]).torch_compile == "layers"
    with pytest.raises(SystemExit):
        parse_args(["--torch-compile", "fast"])
    with pytest.raises(ValueError, match="torch_compile: expected one of"):
        compile_model(_model(), "auto")  # resolve first


def test_auto_is_layers_on_cuda_when_the_probe_compiles_and_off_otherwise(monkeypatch, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compile_mode("auto", cpu) == "off"
    assert resolve_compile_mode("layers", cpu) == "layers" and resolve_compile_mode("off", cuda) == "off"
    monkeypatch.setattr(common, "_compile_probe", lambda device: None)
    suppress = torch._dynamo.config.suppress_errors
    try:
        torch._dynamo.config.suppress_errors = False
        assert resolve_compile_mode("auto", cuda) == "layers"
        assert torch._dynamo.config.suppress_errors  # auto: a graph that cannot be built runs eager
    finally:
        torch._dynamo.config.suppress_errors = suppress
    monkeypatch.setattr(common, "_compile_probe", lambda device: "RuntimeError: Failed to find C compiler")
    with caplog.at_level("WARNING", logger="arctic_rl.server"):
        assert resolve_compile_mode("auto", cuda) == "off"
    assert "Failed to find C compiler" in caplog.text and "training runs eager" in caplog.text


@pytest.mark.slow
def test_compile_probe_really_compiles_here():
    """The probe compiles and differentiates on this machine's CPU (inductor, a C compiler) and caches it."""
    common._COMPILE_PROBE.pop("cpu", None)
    assert common._compile_probe(torch.device("cpu")) is None
    assert common._COMPILE_PROBE["cpu"] is None


def test_compile_model_picks_layers_or_norms_and_mlps():
    assert compile_model(_model(), "off") == 0
    model = _model()
    assert compile_model(model, "layers") == LAYERS
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)
    model = _model()
    # per layer: input/post-attention norms, q_norm and k_norm (Qwen3), and the MLP
    assert compile_model(model, "modules") == 5 * LAYERS
    compiled = {type(m).__name__ for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None}
    assert compiled == {"Qwen3RMSNorm", "Qwen3MLP"}
    assert model.model.layers[0]._compiled_call_impl is None  # attention (and its wrapper) stays eager


def test_recompiles_are_logged_with_their_guard_unless_torch_logs_is_set(monkeypatch, capfd):
    """A recompile after a job's warm-up costs seconds: ``log_recompiles`` (called when the warm-up ends) has
    Dynamo write each one and the guard that failed to the server's log (stderr); TORCH_LOGS, where the process
    set it, stays the process's choice."""
    from torch._dynamo.testing import CompileCounter

    monkeypatch.delenv("TORCH_LOGS", raising=False)
    torch._logging.set_logs()
    try:
        fn = torch.compile(lambda x: x * 2, backend=CompileCounter())
        fn(torch.ones(3))
        fn(torch.ones(3, 2))  # recompiles: rank changed
        assert "Recompiling function" not in capfd.readouterr().err  # not logged by default
        assert common.log_recompiles() is True
        fn(torch.ones(3, 2, 2))
        err = capfd.readouterr().err
        assert "Recompiling function" in err and "rank mismatch. expected" in err
        torch._logging.set_logs()
        monkeypatch.setenv("TORCH_LOGS", "graph_breaks")
        assert common.log_recompiles() is False
    finally:
        torch._logging.set_logs()


def _batch(rows: int = 4, p: int = 6, r: int = 5, n: int = 2):
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(1, 64, (rows // n, p), generator=g).repeat_interleave(n, 0)
    ids = torch.cat([prompts, torch.randint(1, 64, (rows, r), generator=g)], 1)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # a left-padded prompt (its group shares it)
    mask[1, 0] = 0
    mask[2, -1] = 0  # a right-padded response
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, pos, p


def _run(model, zorro: bool):
    ids, mask, pos, p = _batch()
    out = response_logprobs(model, ids, mask, pos, p, calculate_entropy=True, zorro=zorro)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    grads = torch.cat([q.grad.flatten() for q in model.parameters()])
    return out.logprobs.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("mode, zorro", [("modules", False), ("modules", True), ("layers", False), ("layers", True)])
def test_compiled_model_matches_eager(mode, zorro):
    torch._dynamo.reset()
    want_lp, want_grad = _run(_model(), zorro)
    model = _model()
    assert compile_model(model, mode) > 0
    got_lp, got_grad = _run(model, zorro)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-4)
    assert (want_grad != 0).any()


@pytest.mark.slow
def test_zorro_does_not_compile_a_graph_per_layer():
    """With whole-layer compilation, ZoRRO's passes reuse one set of graphs for all layers.

    A KV cache would make each layer specialise on its ``layer_idx`` (one graph per layer, eager
    after Dynamo's recompile limit of 8); ZoRRO's attention wrapper keeps the layer index out of
    the graphs, so 12 layers compile no more graphs than 2 do.
    """
    from torch._dynamo.utils import counters

    graphs = {}
    for layers in (2, 12):
        torch._dynamo.reset()
        counters.clear()
        model = _model(layers=layers)
        compile_model(model, "layers")
        for _ in range(2):
            _run(model, zorro=True)
        graphs[layers] = counters["stats"]["unique_graphs"]
    assert 0 < graphs[12] == graphs[2], graphs


@pytest.mark.slow
def test_a_plain_pass_after_zorro_runs_the_plain_graphs():
    """ZoRRO's attention wrapper is a graph break in every layer; it is the model's attention only while
    ZoRRO's passes run, so a plain pass after them reuses the plain pass's single graph (no new graphs,
    no graph breaks) and gives the eager model's numbers, and passes can alternate without recompiling."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    want_lp, want_grad = _run(_model(layers=4), zorro=False)
    model = _model(layers=4)
    compile_model(model, "layers")
    _run(model, zorro=False)
    plain = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    assert plain == (1, 0)
    _run(model, zorro=True)
    assert model.config._attn_implementation == "sdpa"
    after_zorro = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
    assert after_zorro[0] > plain[0] and after_zorro[1] > 0
    model.zero_grad()
    got_lp, got_grad = _run(model, zorro=False)
    for _ in range(2):
        _run(model, zorro=True)
        _run(model, zorro=False)
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == after_zorro
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, want_grad, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_training_engine_applies_the_setting_and_trains_like_eager(tmp_path):
    """``TrainingEngine`` under ``torch_compile="layers"`` with ZoRRO: compiled layers, the eager losses."""
    from arctic_rl.protocol import JobConfig, JobType
    from arctic_rl.server.engines.training import TrainingEngine
    from arctic_rl.server.http.validation import parse_batch_body
    from arctic_rl.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", "qwen3", seed=0)
    ids, mask, pos, p = _batch()
    ids = ids % 90 + 3  # inside the char tokenizer's vocabulary
    g = torch.Generator().manual_seed(5)
    body = {"batch": {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "prompts": ids[:, :p],
                      "responses": ids[:, p:], "response_mask": mask[:, p:],
                      "advantages": torch.randn(ids.shape[0], ids.shape[1] - p, generator=g),
                      "old_log_probs": torch.full((ids.shape[0], ids.shape[1] - p), -4.0)},
            "meta": {"zorro_train_enable": True, "rollout_n": 2}, "processing": {"loss_fn": "grpo", "config": {}}}
    losses = {}
    for mode in ("off", "layers"):
        config = JobConfig(model_name=str(model_dir), job_type=JobType.TRAINING,
                           ds_config={"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
        engine = TrainingEngine(config, ServerSettings(torch_compile=mode, checkpoint_root=tmp_path / "ck"),
                                tmp_path / mode)
        try:
            compiled = [m for m in engine.model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
            assert len(compiled) == (0 if mode == "off" else engine.model.config.num_hidden_layers)
            assert engine.info()["torch_compile"] == mode
            batch = parse_batch_body(body, vocab_size=engine.vocab_size, train=True)
            losses[mode] = []
            for _ in range(2):  # the second call runs on the weights the first step changed
                losses[mode].append(engine.forward_backward(batch)["metrics"]["loss"])
                engine.step()
        finally:
            engine.close()
    assert losses["off"][0] != losses["off"][1]
    torch.testing.assert_close(losses["layers"], losses["off"], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compiled_token_stats_match_eager():
    """``set_compiled_token_stats(True)``: the fused log-prob / entropy chunks give the eager values and gradients."""
    from arctic_rl.server.compute import token_logprobs as logprobs

    torch.manual_seed(0)
    logits = torch.randn(6, 5, 50, requires_grad=True)
    targets = torch.randint(0, 50, (6, 5))

    def run():
        logits.grad = None
        lp, ent = logprobs._token_stats(logits, targets, 0.7, True)
        (lp.sum() + 0.3 * ent.sum()).backward()
        return lp.detach(), ent.detach(), logits.grad.clone()

    want = run()
    logprobs.set_compiled_token_stats(True)
    try:
        assert logprobs._CHUNK_FNS["stats"] is not logprobs._chunk_stats
        got = run()
    finally:
        logprobs.set_compiled_token_stats(False)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
