"""``benchmarks/max_model.py`` and its modules on a CPU: the model builder, the real sizes' shapes, the commands,
the run loop (OOM escalation, timeouts, skipping) with stand-in scripts, and the report of a results folder.

The GPU runs themselves happen on the lent H200 (the module's docstring); here every part that decides what
they run and how their files are read is exercised: ``qwen3_random`` builds a ``tiny`` Qwen3 with the same code
as the real sizes, ``--dry-run`` prints the overrides of each level, the loop runs stand-in scripts that fail
with an OOM line, time out or log two steps, and ``--report`` reads folders shaped as a real run leaves them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mm():
    return load_script("benchmarks/max_model.py")


@pytest.fixture(scope="module")
def q3():
    return load_script("benchmarks/qwen3_random.py")


def test_real_sizes_have_qwen3_shapes_and_parameter_counts(q3):
    """Each size's count from its shape is within 10% of its name, equals what transformers builds (on the meta
    device: nothing allocated), and the shapes are Qwen3's (head_dim 128, vocabulary 151,936, tied up to 4B)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    for size, nominal in q3.NOMINAL_B.items():
        s = q3.shape(size)
        assert s["head_dim"] == 128 and s["vocab_size"] == 151936 and s["num_key_value_heads"] == 8
        assert s["tie_word_embeddings"] is (size in ("0.6b", "1.7b", "4b"))
        assert abs(q3.param_count(size) / 1e9 / nominal - 1) < 0.10, (size, q3.param_count(size))
    for size in ("0.6b", "8b"):  # one tied, one untied
        with torch.device("meta"):
            model = Qwen3ForCausalLM(Qwen3Config(**q3.shape(size)))
        assert sum(p.numel() for p in model.parameters()) == q3.param_count(size)
    assert q3.shape("8b")["hidden_size"] == 4096 and q3.shape("8b")["intermediate_size"] == 12288


def test_tiny_model_builds_loads_and_decodes_every_id(q3, tiny_model_dir, tmp_path):
    """The builder's output: a Qwen3ForCausalLM in bf16, safetensors, its tokenizer padded to the vocabulary
    (every id decodes, the special ids keep theirs), the chat template kept, and the marker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = q3.build_model("tiny", tmp_path / "tiny", tiny_model_dir, device="cpu")
    marker = json.loads((out / q3.MARKER).read_text())
    vocab = marker["shape"]["vocab_size"]
    assert marker["tokenizer_ids"] < vocab == marker["tokenizer_padded_to"]
    assert marker["params"] == marker["params_from_shape"] == q3.param_count("tiny", vocab)
    assert list(out.glob("*.safetensors"))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["vocab_size"] == vocab
    tok = AutoTokenizer.from_pretrained(str(out))
    src = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert len(tok) == vocab and tok.eos_token_id == src.eos_token_id < vocab == config["vocab_size"]
    assert config["eos_token_id"] == tok.eos_token_id and config["pad_token_id"] == tok.pad_token_id
    assert tok.decode([vocab - 1]) == f"<fill_{vocab - 1}>"
    text = "What is 17 + 25? Answer with just the number."
    assert tok(text)["input_ids"] == src(text)["input_ids"] and tok.chat_template
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    ids = torch.tensor([tok(text)["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], vocab)
    assert q3.build_model("tiny", out, tiny_model_dir) == out  # finished: kept


@pytest.mark.slow
def test_smollm2_tokenizer_padded_encodes_as_before(q3, smollm2_model_dir, tmp_path):
    """The real case: SmolLM2's tokenizer (49,152 ids) padded for a ``tiny`` model renders the recipe's chat
    prompts to the same ids, and its filler ids decode."""
    from transformers import AutoTokenizer

    out = q3.build_model("tiny", tmp_path / "tiny", smollm2_model_dir, device="cpu")
    tok, src = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(smollm2_model_dir))
    messages = [{"role": "user", "content": "What is 17 + 25? Answer with just the number."}]
    assert str(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)) == str(
        src.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert len(tok) == 49152 + 128 and tok.decode([49152]) == "<fill_49152>" and tok.eos_token_id == 2


def test_dry_run_prints_each_levels_overrides(mm, capsys):
    mm.main(["--dry-run", "--work", "/tmp/mm_dry", "--sizes", "0.6b,8b", "--env-file", ""])
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("cd ")]
    assert len(lines) == 2 * (4 + 3)  # arctic: base, gc, offload, offload3; stock: base, gc, offload
    for line in lines:
        assert "BATCH=64 N=8 PROMPT_LEN=512 RESP_LEN=512" in line and "MODEL_BUILD=never" in line
        assert "trainer.save_freq=-1" in line
    arctic3 = next(line for line in lines if "RUN_NAME=8b_arctic_offload3 " in line)
    for key in ("remote_backend.train.deepspeed.zero_stage=3", "remote_backend.train.deepspeed.offload_optimizer=true",
                "remote_backend.train.deepspeed.offload_param=true",
                "actor_rollout_ref.model.enable_gradient_checkpointing=True", "GPU_MEMORY_UTILIZATION=0.3",
                "MODEL_DIR=/tmp/mm_dry/models/qwen3_8b", "run_arithmetic_grpo_smollm2.sh"):
        assert key in arctic3, key
    stock = next(line for line in lines if "RUN_NAME=8b_stock_offload " in line)
    assert "actor_rollout_ref.actor.fsdp_config.param_offload=True" in stock
    assert "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True" in stock and "_stock.sh" in stock
    base = next(line for line in lines if "RUN_NAME=0.6b_stock_base " in line)
    assert "offload" not in base.split("_stock.sh", 1)[1] and "enable_gradient_checkpointing" not in base
    for line, size in ((arctic3, "8b"), (stock, "8b"), (base, "0.6b")):  # the header's model, quoted for the shell
        assert f"MODEL_LABEL='{mm.model_label(size)}'" in line
    assert mm.model_label("8b").startswith("random-weight Qwen3-shaped 8b (8,")
    assert "--size 8b --out /tmp/mm_dry/models/qwen3_8b" in out


STAND_IN = """#!/usr/bin/env bash
# stand-in for an arithmetic script: OOM without activation checkpointing; SLEEP=1 hangs; else logs $STEPS steps
run_dir="$OUT_DIR/runs/$RUN_NAME"; mkdir -p "$run_dir"
if [ "${SLEEP:-0}" = 1 ]; then sleep 60; fi
case " $* " in
  *enable_gradient_checkpointing=True*) ;;
  *) echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 9.27 GiB" >> "$run_dir/run.log"
     sleep 60; exit 1 ;;  # hangs after the OOM, as a Ray job may: stopped after --oom-grace
esac
for k in $(seq 1 "$STEPS"); do
  echo "{\\"step\\": $k, \\"data\\": {\\"timing_s/step\\": 1$k.5, \\"$MEM_KEY\\": 2$k.0}}" >> "$run_dir/metrics.jsonl"
done
echo "[grpo] done" > "$run_dir/run.log"
"""


def test_loop_escalates_on_oom_carries_the_level_and_skips_after_a_failure(mm, tiny_model_dir, tmp_path,
                                                                           monkeypatch):
    """arctic: tiny OOMs at ``base``, fits at ``gc``; 0.6b starts at ``gc``. stock: tiny times out, so 0.6b is
    skipped. Every run leaves its folder, the status file its lines and ALLDONE, report.md the table."""
    scripts = {}
    for side, key, sleep in (("arctic", "actor/arctic/memory/training/device_max_allocated_gib", "0"),
                             ("stock", "perf/max_memory_allocated_gb", "1")):
        path = tmp_path / f"{side}.sh"
        path.write_text(STAND_IN.replace("$MEM_KEY", key).replace("${SLEEP:-0}", sleep))
        scripts[side] = str(path)
    monkeypatch.setattr(mm, "SCRIPTS", scripts)
    monkeypatch.setattr(mm.Runner, "build", lambda self, size: True)  # the builder is tested above
    monkeypatch.setattr(mm.Runner, "poll_s", 0.2)
    work = tmp_path / "work"
    (work / "data_short").mkdir(parents=True)  # the data as make_data.py leaves it (its run takes seconds)
    (work / "data_short" / "data_info.json").write_text(json.dumps({"prompt_tokens_max": 61}))
    args = mm.parse_args(["--work", str(work), "--sizes", "tiny,0.6b", "--no-snapshot", "--env-file", "",
                          "--tokenizer-from", str(tiny_model_dir), "--prompts", "short", "--run-timeout", "3", "--oom-grace", "0.5",
                          "--python", sys.executable])
    mm.Runner(args).run()
    results = {p.parent.name: json.loads(p.read_text()) for p in (work / "results").glob("*/result.json")}
    assert {k: v["outcome"] for k, v in results.items()} == {
        "tiny_arctic_base": "oom", "tiny_arctic_gc": "fit", "0.6b_arctic_gc": "fit", "tiny_stock_base": "timeout"}
    assert "CUDA out of memory" in results["tiny_arctic_base"]["evidence"]
    assert "CUDA out of memory" in results["tiny_arctic_base"]["stopped_after_oom"]
    assert results["tiny_arctic_base"]["wall_s"] < 3 and not results["tiny_arctic_base"]["timed_out"]
    fit = results["0.6b_arctic_gc"]
    assert fit["step_times_s"] == [11.5, 12.5] and fit["step_time_s"] == 12.5 and fit["process_peak_gib"] == 22.0
    assert fit["overrides"][-1] == "actor_rollout_ref.model.enable_gradient_checkpointing=True"
    assert json.loads((work / "results/0.6b_stock_skipped/attempt.json").read_text())["outcome"] == "skipped"
    status = (work / "status").read_text()
    assert "start tiny_arctic_base" in status and "outcome=timeout" in status and status.rstrip().endswith("ALLDONE")
    table = (work / "report.md").read_text()
    assert "| 0.6b | 0.60 B | arctic | ZeRO-1, act. ckpt, vLLM 0.4 | **fit** |" in table
    assert "- largest size that fit, arctic: 0.6b" in table and "- largest size that fit, stock: none" in table


def _write_run(results: Path, name: str, size: str, side: str, level: str, *, steps: list[dict], gpu_mib: list[int],
               console: str, finished: bool, rc: int, mm) -> None:
    folder = results / name
    folder.mkdir(parents=True)
    attempt = {"name": name, "size": size, "side": side, "level": level, "level_index": mm.LEVELS.index(level),
               "params": mm.qwen3_random.param_count(size), "settings_text": mm.LEVEL_SETTINGS[level][side][2],
               "run_dir": str(folder / "absent"), "steps_wanted": 2}
    (folder / "attempt.json").write_text(json.dumps(attempt))
    (folder / "console.txt").write_text(console)
    (folder / "gpu_mem.csv").write_text("".join(f"{m}, 143771\n" for m in gpu_mib))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "data": d}) + "\n"
                                                  for i, d in enumerate(steps)))
    if finished:
        result = {**attempt, "rc": rc, "wall_s": 321.0, **mm.report.analyze(folder, rc=rc, steps_wanted=2)}
        (folder / "result.json").write_text(json.dumps(result))


def test_report_reads_a_results_folder(mm, tmp_path, capsys):
    """Finished runs (result.json) and one whose runner died (attempt.json alone: analysed from its files)."""
    results = tmp_path / "w" / "results"
    _write_run(results, "8b_stock_offload", "8b", "stock", "offload", mm=mm, finished=True, rc=0,
               steps=[{"timing_s/step": 80.0, "perf/max_memory_allocated_gb": 61.0},
                      {"timing_s/step": 70.25, "perf/max_memory_allocated_gb": 63.5}],
               gpu_mib=[1000, 98304, 90000], console="[stock_verl] step 2/2\n")
    _write_run(results, "8b_arctic_gc", "8b", "arctic", "gc", mm=mm, finished=True, rc=1, steps=[],
               gpu_mib=[140000], console="RuntimeError: server said 500: CUDA out of memory. Tried to allocate\n")
    _write_run(results, "4b_arctic_base", "4b", "arctic", "base", mm=mm, finished=False, rc=0, steps=[],
               gpu_mib=[5000], console="ValueError: No available memory for the cache blocks.\n")
    mm.main(["--report", str(tmp_path / "w")])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("| 4b", "| 8b"))]
    assert [r.split("|")[3].strip() for r in rows] == ["arctic", "arctic", "stock"]  # by size, then side
    assert "**oom**" in rows[0] and "No available memory" in rows[0]
    assert "**oom**" in rows[1] and "136.7" in rows[1]  # 140,000 MiB
    assert "**fit**" in rows[2] and "| 96.0 | 63.5 | 70.2 (2) | 321 |" in rows[2]
    assert "- largest size that fit, stock: 8b" in out and "- largest size that fit, arctic: none" in out


@pytest.mark.parametrize("with_config", [True, False])
def test_recipe_takes_a_finished_model_dir_with_model_build_never(tmp_path, with_config):
    """``MODEL_BUILD=never`` (what the runs set): arithmetic.sh's prepare step uses MODEL_DIR as it is -- no
    SmolLM2 build into it -- and refuses, naming it, a directory without config.json."""
    import subprocess

    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    (data / "train.parquet").write_text("")
    (data / "val.parquet").write_text("")
    if with_config:
        (model / "config.json").write_text("{}")
    script = (f'source "{REPO}/examples/common/arithmetic.sh"; MODEL_BUILD=never MODEL_DIR="{model}" '
              f'DATA_DIR="{data}"; arithmetic_prepare; echo prepared')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False)
    if with_config:
        assert done.returncode == 0 and done.stdout.strip() == "prepared", done.stderr
    else:
        assert done.returncode == 2 and f"MODEL_DIR={model} holds no config.json" in done.stderr


@pytest.mark.parametrize("given", [None, "random-weight Qwen3-shaped 4b"])
def test_the_run_header_names_the_model_label(tmp_path, given):
    """The scripts' console header names ``MODEL_LABEL`` (what max_model.py sets for its random models),
    SmolLM2-135M-Instruct by default."""
    import subprocess

    label = f"MODEL_LABEL='{given}' " if given else ""
    script = (f'source "{REPO}/examples/common/arithmetic.sh"; PROMPT_STYLE=short DEVICE=cpu OUT_DIR="{tmp_path}" '
              f'SEED=0 {label}; arithmetic_settings; echo "$MODEL_LABEL"')
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (given or "SmolLM2-135M-Instruct")
    for name in ("run_arithmetic_grpo_smollm2.sh", "run_arithmetic_grpo_smollm2_stock.sh"):
        text = (REPO / "examples" / "grpo" / name).read_text()
        header = text[text.index("console_header"):].split("\n")[1]
        assert header.strip().startswith('"arithmetic GRPO: ${MODEL_LABEL}, ${PROMPT_STYLE} prompts'), (name, header)
