"""The contract kit (``verl.remote_backend.contract``) passes a backend that keeps the contract and names
the method of one that breaks it.

The backend under test here is a complete in-process one (a unigram policy trained by the GRPO
surrogate), small enough to run in milliseconds, and broken one method at a time. The kit's run against
the Arctic adapter on the reference server is the slow test at the bottom; the static check of every
registered backend is in ``test_remote_backend_contract_on_cpu.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import no_padding_2_padding

from verl.remote_backend.base import RemoteBackend
from verl.remote_backend.contract import (
    LIFECYCLE_METHODS,
    ContractError,
    as_read,
    check_backend_class,
    fake_batch,
    fake_prompts,
    run_contract,
)
from verl.remote_backend.protocols import ACTOR_METHODS

VOCAB = 100


class Unigram(RemoteBackend):
    """Every token drawn from one softmax over the vocabulary; ``update_actor`` takes SGD steps on the
    GRPO surrogate, one per mini-batch."""

    def __init__(self) -> None:
        self.saved: dict[int, torch.Tensor] = {}
        self.logits = torch.zeros(VOCAB)
        self.ref = self.logits.clone()

    @classmethod
    def from_config(cls, main_config, *, handle=None):
        return cls()

    def reconnect_handle(self) -> dict:
        return {"backend": "unigram"}

    def destroy(self) -> None:
        pass

    def requires_single_forwarder(self) -> bool:
        return True

    def _log_probs(self, data, logits: torch.Tensor):
        ids = data["input_ids"]
        values = torch.log_softmax(logits, -1)[ids.values()]
        # value k of a row = log p(token k+1): shift left within each row
        shifted = torch.cat([values[1:], values[:1]])
        lp = torch.nested.nested_tensor_from_jagged(shifted, offsets=ids.offsets())
        return tu.get_tensordict({"log_probs": lp}, non_tensor_dict={"metrics": {"mfu": 0.0}})

    def compute_log_prob(self, data):
        return self._log_probs(data, self.logits)

    def compute_ref_log_prob(self, data):
        return self._log_probs(data, self.ref)

    def update_actor(self, data):
        mini = int(tu.get(data, "mini_batch_size"))
        rows = data["response_mask"].shape[0]
        losses = []
        for start in range(0, rows, mini):
            logits = self.logits.clone().requires_grad_(True)
            lp = no_padding_2_padding(self._log_probs(data, logits)["log_probs"], data)[start:start + mini]
            mask = data["response_mask"][start:start + mini]
            loss = -(lp * data["advantages"][start:start + mini] * mask).sum() / mask.sum()
            loss.backward()
            self.logits = (logits - 0.1 * logits.grad).detach()
            losses.append(float(loss.detach()))
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"actor/pg_loss": losses}})

    def update_weights(self):
        return None

    def save_checkpoint(self, step=None):
        self.saved[int(step or 0)] = self.logits.clone()
        return {"global_step": int(step or 0), "path": f"memory://{step}"}

    def load_checkpoint(self, step=None):
        self.logits = self.saved[int(step or 0)].clone()
        return {"global_step": int(step or 0)}

    def generate(self, prompts, sampling_params=None):
        params = sampling_params or {}
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in prompts:
            for _ in range(int(params.get("n", 1))):
                tokens = torch.multinomial(torch.softmax(self.logits, -1), int(params.get("max_tokens", 4)),
                                           replacement=True, generator=g).tolist()
                logps = torch.log_softmax(self.logits, -1)[tokens].tolist()
                out.append({"token_ids": tokens, "logprobs": logps, "finish_reason": "length"})
        return out


def test_a_backend_that_keeps_the_contract_passes_every_method():
    check_backend_class(Unigram)
    backend = Unigram()
    report = run_contract(backend, prompts=2, n=3, mini_batch_rows=3)
    assert set(report.seconds) == {*LIFECYCLE_METHODS, *ACTOR_METHODS, "generate"} - {"from_config", "destroy"}
    assert report.update_metrics == ["actor/pg_loss"] and report.samples == 6
    assert not torch.equal(backend.logits, torch.zeros(VOCAB))  # the update applied
    assert torch.equal(backend.logits, backend.saved[1])  # and was saved and loaded back as step 1
    json.dumps(report.saved)


def test_the_fake_batch_is_verls_shape():
    data = fake_batch(prompts=3, n=2, mini_batch_rows=2)
    ids = data["input_ids"]
    assert ids.is_nested and ids.offsets().numel() == 3 * 2 + 1
    assert data["response_mask"].shape[0] == 6 and tu.get(data, "mini_batch_size") == 2
    prompts = fake_prompts(data, 2)
    assert len(prompts) == 3 and all(0 < len(p) <= 6 for p in prompts)
    rows = ids.unbind()
    assert rows[0][: len(prompts[0])].tolist() == rows[1][: len(prompts[0])].tolist() == prompts[0]  # a GRPO group


class WrongOffsets(Unigram):
    def compute_log_prob(self, data):
        out = super().compute_log_prob(data)
        values = out["log_probs"].values()
        return tu.get_tensordict({"log_probs": torch.nested.nested_tensor_from_jagged(
            values[:-1], offsets=torch.tensor([0, values.numel() - 1]))})


class PositiveLogProbs(Unigram):
    def compute_ref_log_prob(self, data):
        out = super().compute_ref_log_prob(data)
        lp = out["log_probs"]
        return tu.get_tensordict({"log_probs": torch.nested.nested_tensor_from_jagged(-lp.values(), lp.offsets())})


class OneMetricPerCall(Unigram):
    def update_actor(self, data):
        out = super().update_actor(data)
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"actor/pg_loss": [tu.get(out, "metrics")[
            "actor/pg_loss"][0]]}})


class OneSamplePerPrompt(Unigram):
    def generate(self, prompts, sampling_params=None):
        return super().generate(prompts, {**(sampling_params or {}), "n": 1})


class TooManyTokens(Unigram):
    def generate(self, prompts, sampling_params=None):
        return super().generate(prompts, {**(sampling_params or {}), "max_tokens": 9})


class HandleWithAnObject(Unigram):
    def reconnect_handle(self) -> dict:
        return {"client": object()}


class CheckpointNotJson(Unigram):
    def save_checkpoint(self, step=None):
        return {**super().save_checkpoint(step), "tensor": torch.zeros(1)}


class UnnamedStep(Unigram):
    def save_checkpoint(self):  # PR #7102's shape: verl's worker names the step
        return super().save_checkpoint(None)


class UndeclaredAdopter(Unigram):
    def adopt_sampler(self, data) -> None:
        pass


class DeclaresItsFields(Unigram):
    """Reads ``input_ids`` to compute; to update, ``prompts``, ``responses`` and ``attention_mask`` (verl's
    ``no_padding_2_padding``), ``response_mask`` and ``advantages`` besides: says so."""

    @classmethod
    def tensor_fields_read(cls, method):
        if method != "update_actor":
            return {"input_ids"}
        return {"input_ids", "prompts", "responses", "attention_mask", "response_mask", "advantages"}


class DeclaresTooFewToUpdate(DeclaresItsFields):
    @classmethod
    def tensor_fields_read(cls, method):
        return {"input_ids"}


class ReadsAnUndeclaredFieldSilently(DeclaresItsFields):
    def compute_log_prob(self, data):  # an optional field: absent, the answer changes without an error
        tilt = torch.arange(VOCAB) / VOCAB if data.get("advantages", None) is not None else torch.zeros(VOCAB)
        return self._log_probs(data, self.logits + tilt)


class DeclaresAString(Unigram):
    @classmethod
    def tensor_fields_read(cls, method):
        return "input_ids"


def test_a_backend_that_declares_the_fields_it_reads_passes_on_the_narrowed_batch():
    check_backend_class(DeclaresItsFields)
    data = fake_batch(prompts=2, n=2)
    narrowed = as_read(DeclaresItsFields(), "compute_log_prob", data)
    others = {k for k in data.keys() if not isinstance(data.get(k), torch.Tensor)}  # noqa: SIM118 (a TensorDict)
    assert set(narrowed.keys()) == {"input_ids", *others}
    assert as_read(Unigram(), "compute_log_prob", data) is data  # declares nothing: the whole batch
    report = run_contract(DeclaresItsFields(), prompts=2, n=3, mini_batch_rows=3)
    assert report.update_metrics == ["actor/pg_loss"]


@pytest.mark.parametrize("broken, method", [
    (DeclaresTooFewToUpdate, "update_actor"),
    (ReadsAnUndeclaredFieldSilently, "compute_log_prob"),
    (DeclaresAString, "tensor_fields_read('compute_log_prob')"),
    (WrongOffsets, "compute_log_prob"),
    (PositiveLogProbs, "compute_ref_log_prob"),
    (OneMetricPerCall, "update_actor"),
    (OneSamplePerPrompt, "generate"),
    (TooManyTokens, "generate"),
    (HandleWithAnObject, "reconnect_handle"),
    (CheckpointNotJson, "save_checkpoint"),
    (UnnamedStep, "save_checkpoint"),
    (UndeclaredAdopter, "adopt_sampler"),
])
def test_a_broken_method_is_named(broken, method):
    with pytest.raises(ContractError) as err:
        run_contract(broken(), prompts=2, n=2, mini_batch_rows=2)
    assert err.value.method.endswith(method), err.value


def test_an_abstract_or_foreign_class_is_refused():
    class Lifecycle(RemoteBackend):
        pass

    with pytest.raises(ContractError, match="abstract"):
        check_backend_class(Lifecycle)
    with pytest.raises(ContractError, match="not a RemoteBackend"):
        check_backend_class(type("NotABackend", (), {}))


@pytest.mark.slow
def test_the_arctic_adapter_keeps_the_contract_on_the_reference_server(reference_server, tiny_model_dir):
    from tests.support.reliability import client_config
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient

    cfg = client_config(tiny_model_dir, reference_server.url)
    client = ArcticRLClient.from_config(cfg)
    try:
        report = run_contract(client, cfg)
    finally:
        client.destroy()
    assert report.samples == 2 * 2 and "actor/pg_loss" in report.update_metrics
    assert report.saved["global_step"] == 1
