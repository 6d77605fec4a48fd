"""The reference server's sampling job and weight sync, against a real server process.

Covers: seeded reproducibility, ``n`` samples grouped by prompt, ``max_tokens``/stop strings/stop
token ids and ``finish_reason``, token-id prompts, sampled-token log-probs equal to a direct
``transformers`` computation, the compact answer (``compact_results``), weight sync making the sampler agree
with the trainer, the v1 JSON ``/generate``, bad sampling input, and ``/health`` staying responsive during
generation.
"""



import threading
import time

import pytest
import requests
import torch

from arctic_rl.protocol import sampled_logprobs
from tests.support.server import decode, make_batch, post_frame

pytestmark = pytest.mark.slow

PROMPT_IDS = [[5, 6, 7, 8, 9], [10, 11, 12]]


@pytest.fixture(scope="module")
def srv(reference_server, tiny_model_dir):
    """The module's server, holding a sampling job."""
    sampling = decode(requests.post(reference_server.url + "/initialize",
                                    json={"model_name": str(tiny_model_dir), "job_type": "sampling"}))
    reference_server.sampling_id = sampling["job_id"]
    return reference_server


def sampled(result) -> list[float]:
    """The sampled tokens' log-probs of a result (the wire holds ``{token_id: {logprob, rank}}`` per token)."""
    return sampled_logprobs(result["token_ids"], result["logprobs"])


def generate(srv, prompts, **params):
    return decode(
        post_frame(srv, f"/generate?job_id={srv.sampling_id}", {"prompts": prompts, "sampling_params": params})
    )["results"]


def direct_token_logprobs(model_dir, prompt, tokens, temperature=1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)


def test_seeded_generation_is_reproducible(srv):
    a = generate(srv, PROMPT_IDS, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True, logprobs=0)
    b = generate(srv, PROMPT_IDS, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True, logprobs=0)
    c = generate(srv, PROMPT_IDS, temperature=1.0, max_tokens=12, seed=8, ignore_eos=True, logprobs=0)
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
    assert [r["logprobs"] for r in a] == [r["logprobs"] for r in b]
    assert [r["token_ids"] for r in a] != [r["token_ids"] for r in c]


def test_n_samples_grouped_by_prompt(srv):
    results = generate(srv, PROMPT_IDS, temperature=1.0, max_tokens=8, n=3, seed=1, ignore_eos=True)
    assert len(results) == 6
    assert [(r["prompt_index"], r["sample_index"]) for r in results] == [(i, s) for i in range(2) for s in range(3)]
    assert [r["prompt_len"] for r in results] == [5, 5, 5, 3, 3, 3]
    assert len({tuple(r["token_ids"]) for r in results[:3]}) > 1  # really different samples
    assert all(r["logprobs"] is None and r["prefix_cache_len"] == 0 for r in results)


def test_max_tokens_stop_ids_and_stop_strings(srv, tiny_model_dir):
    from transformers import AutoTokenizer

    decode_ids = AutoTokenizer.from_pretrained(tiny_model_dir).decode
    greedy = generate(srv, PROMPT_IDS[:1], temperature=0, max_tokens=10, ignore_eos=True)[0]
    tokens = greedy["token_ids"]
    assert (greedy["generation_len"], greedy["finish_reason"], len(tokens)) == (10, "length", 10)
    # a stop token id ends the sample at its first occurrence, the token kept
    stop_tok = tokens[3]
    cut = tokens.index(stop_tok) + 1
    stopped = generate(srv, PROMPT_IDS[:1], temperature=0, max_tokens=10, stop_token_ids=[stop_tok], ignore_eos=True)[0]
    assert stopped["token_ids"] == tokens[:cut] and stopped["finish_reason"] == "stop"
    # a stop string: text cut before it, tokens up to the one that completed it
    stop_text = greedy["text"][4:6]
    k = next(k for k in range(1, 11) if stop_text in decode_ids(tokens[:k], skip_special_tokens=True))
    by_text = generate(srv, PROMPT_IDS[:1], temperature=0, max_tokens=10, stop=[stop_text], ignore_eos=True)[0]
    assert by_text["finish_reason"] == "stop" and by_text["token_ids"] == tokens[:k]
    assert by_text["text"] == greedy["text"][: greedy["text"].find(stop_text)]


def test_token_prompts_equal_text_prompts_and_logprobs_are_exact(srv, tiny_model_dir):
    from transformers import AutoTokenizer

    text = "hello world"
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(text)["input_ids"]
    by_text = generate(srv, [text], temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)[0]
    by_ids = generate(srv, [ids], temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)[0]
    assert by_text["token_ids"] == by_ids["token_ids"] and by_text["prompt_len"] == by_ids["prompt_len"] == len(ids)
    expected = direct_token_logprobs(tiny_model_dir, ids, by_ids["token_ids"])
    assert torch.allclose(torch.tensor(sampled(by_ids)), expected, atol=1e-4)
    # logprobs=0: only the sampled token (vLLM's rule); greedy: it is the most likely, rank 1
    assert all(list(e) == [str(t)] and e[str(t)]["rank"] == 1 for e, t in zip(by_ids["logprobs"], by_ids["token_ids"]))
    # sampled tokens: log-probs of softmax(logits / T) at the sampled token
    sample = generate(srv, [ids], temperature=0.8, max_tokens=6, logprobs=1, seed=3, ignore_eos=True)[0]
    expected = direct_token_logprobs(tiny_model_dir, ids, sample["token_ids"], temperature=0.8)
    assert torch.allclose(torch.tensor(sampled(sample)), expected, atol=1e-4)
    # logprobs=1: the sampled token and the most likely one, ranks counted in that same distribution
    for entry, tok in zip(sample["logprobs"], sample["token_ids"]):
        top = [e for e in entry.values() if e["rank"] == 1]
        assert str(tok) in entry and 1 <= len(entry) <= 2 and len(top) == 1
        assert top[0]["logprob"] >= entry[str(tok)]["logprob"]
        assert (entry[str(tok)]["rank"] == 1) == (len(entry) == 1)


def test_the_compact_answer_holds_the_sampled_log_probs_and_no_text(srv):
    """``compact_results``: the same seeded call answered in the compact shape carries exactly the sampled
    tokens' log-probs of the vendor-shaped answer, one float per token, and no text when asked for none."""
    assert "compact_results" in requests.get(srv.url + "/health", timeout=5).json()["features"]
    common = {"temperature": 1.0, "max_tokens": 10, "seed": 11, "ignore_eos": True, "logprobs": 2, "n": 2}
    vendor = generate(srv, PROMPT_IDS, **common)
    compact = generate(srv, PROMPT_IDS, **common, logprobs_format="sampled", detokenize=False)
    assert [r["token_ids"] for r in compact] == [r["token_ids"] for r in vendor]
    for v, c in zip(vendor, compact):
        assert all(isinstance(x, float) for x in c["logprobs"]) and len(c["logprobs"]) == len(c["token_ids"])
        assert c["logprobs"] == pytest.approx(sampled(v), abs=1e-6)
        assert all(len(entry) >= 2 for entry in v["logprobs"])  # the vendor shape keeps its top tokens
        assert c["text"] == "" and v["text"] != ""
    text_kept = generate(srv, PROMPT_IDS, **common, logprobs_format="sampled")
    assert [r["text"] for r in text_kept] == [r["text"] for r in vendor]
    none_asked = generate(srv, PROMPT_IDS, temperature=1.0, max_tokens=4, seed=3, logprobs_format="sampled")
    assert all(r["logprobs"] is None for r in none_asked)


def test_v1_json_generate(srv):
    body = {"prompts": ["abc", "de"], "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}
    v1 = requests.post(f"{srv.url}/generate?job_id={srv.sampling_id}", json=body, timeout=60)
    assert v1.headers["content-type"].startswith("application/json")
    v2 = generate(srv, body["prompts"], **body["sampling_params"])
    assert [r["token_ids"] for r in v1.json()["results"]] == [r["token_ids"] for r in v2]
    assert v1.json()["job_id"] == srv.sampling_id


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompts": [[5, 6]], "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"prompts": [[5, 6]], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"prompts": [[5, 6]], "sampling_params": {"best_of": 2}}, "sampling_params.best_of"),
        ({"prompts": [[5, 100000]], "sampling_params": {}}, "prompts.0"),
        ({"prompts": [[]], "sampling_params": {}}, "prompts.0"),
        ({"prompts": [""], "sampling_params": {}}, "prompts.0"),
        ({"prompts": [[5]], "sampling_params": {"max_tokens": 5000}}, "sampling_params.max_tokens"),
        ({"prompts": [], "sampling_params": {}}, "prompts"),
        ({"prompts": [[5]], "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids"),
        ({"prompts": [[5]], "sampling_params": {"logprobs_format": "floats"}}, "sampling_params.logprobs_format"),
        ({"prompts": [[5]], "sampling_params": {"detokenize": "maybe"}}, "sampling_params.detokenize"),
    ],
)
def test_bad_generate_input_is_400(srv, body, field):
    response = post_frame(srv, f"/generate?job_id={srv.sampling_id}", body)
    assert response.status_code == 400, response.text
    assert response.json()["detail"]["field"] == field
    assert requests.get(srv.url + "/health", timeout=5).status_code == 200


def test_health_stays_responsive_while_generating(srv):
    done = threading.Event()

    def long_generate():
        try:
            generate(srv, PROMPT_IDS * 4, temperature=1.0, max_tokens=400, ignore_eos=True, seed=0)
        finally:
            done.set()

    worker = threading.Thread(target=long_generate)
    worker.start()
    latencies = []
    time.sleep(0.3)
    while not done.is_set() and len(latencies) < 10:
        t0 = time.perf_counter()
        assert requests.get(srv.url + "/health", timeout=5).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.1)
    worker.join(timeout=300)
    assert latencies, "generation finished before /health was polled"
    assert max(latencies) < 1.0, latencies


def test_weight_sync_makes_the_sampler_equal_the_trainer(srv, tiny_model_dir):
    config = {
        "model_name": str(tiny_model_dir),
        "job_type": "training",
        "ds_config": {"optimizer": {"type": "AdamW", "params": {"lr": 5e-2}}},
    }
    tid = decode(requests.post(srv.url + "/initialize", json=config, timeout=300))["job_id"]
    try:
        sft = make_batch([[5, 6, 7]], [[30, 31, 32, 33]])
        body = {"batch": sft, "meta": {}, "processing": {"loss_fn": "sft"}}
        for _ in range(2):
            decode(post_frame(srv, f"/forward-backward?job_id={tid}", body))
            decode(requests.post(f"{srv.url}/step?job_id={tid}", timeout=60))

        def sampler_vs_trainer():
            sample = generate(srv, [PROMPT_IDS[0]], temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)[0]
            batch = make_batch([PROMPT_IDS[0]], [sample["token_ids"]])
            fwd = decode(post_frame(srv, f"/forward?job_id={tid}", {"batch": batch, "meta": {}, "processing": {}}))
            p = len(PROMPT_IDS[0])
            trainer = fwd["batch"]["logprobs"][0, p - 1 : p - 1 + len(sample["token_ids"])]
            return sample, (torch.tensor(sampled(sample)) - trainer).abs().max().item()

        before, gap_before = sampler_vs_trainer()
        sync = requests.post(
            f"{srv.url}/weight-sync?job_id={tid}",
            json={"source_sub_job_id": tid, "target_sub_job_ids": [srv.sampling_id]},
            timeout=60,
        )
        assert sync.status_code == 200, sync.text
        assert (
            sync.json()["synced"] == [srv.sampling_id] and sync.json()["weight_version"] == before["weight_version"] + 1
        )
        after, gap_after = sampler_vs_trainer()
        assert gap_before > 1e-2 and gap_after < 1e-4, (gap_before, gap_after)
        assert after["weight_version"] == before["weight_version"] + 1
        wrong = requests.post(
            f"{srv.url}/weight-sync?job_id={tid}",
            json={"source_sub_job_id": tid, "target_sub_job_ids": [tid]},
            timeout=60,
        )
        assert wrong.status_code == 400 and wrong.json()["detail"]["field"] == "job_id"
    finally:
        requests.post(f"{srv.url}/destroy?job_id={tid}", json={"job_type": "training"}, timeout=60)
