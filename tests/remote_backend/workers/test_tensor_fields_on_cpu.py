"""``workers/tensor_fields.py``: the forwarder worker's compute methods dispatch verl's way with the batch narrowed
to its tensor fields. The field schemas are TransferQueue's own (``extract_field_schema`` of a TensorDict shaped as
verl's batches are); the metas are TransferQueue's ``KVBatchMeta``. The whole path through Ray and a running
TransferQueue runs in every GRPO e2e test."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict
from transfer_queue import KVBatchMeta
from transfer_queue.metadata import extract_field_schema
from verl.single_controller.base.decorator import MAGIC_ATTR, make_nd_compute_dataproto_dispatch_fn

from verl.remote_backend.protocols import COMPUTE_METHODS, ReadsTensorFields
from verl.remote_backend.workers import tensor_fields as tf
from verl.remote_backend.workers.worker import RemoteActorRolloutRefWorker


def verl_like_batch(rows: int = 4) -> TensorDict:
    ids = torch.nested.as_nested_tensor([torch.arange(3 + i) for i in range(rows)], layout=torch.jagged)
    return TensorDict({
        "input_ids": ids,
        "advantages": torch.nested.as_nested_tensor([torch.ones(2 + i) for i in range(rows)], layout=torch.jagged),
        "rewards": torch.zeros(rows),
        "raw_prompt": NonTensorStack(*[[{"role": "user", "content": f"q{i}"}] for i in range(rows)]),
        "data_source": NonTensorStack(*["arithmetic"] * rows),
    }, batch_size=[rows])


def kv_meta(rows: int = 4, fields=None) -> KVBatchMeta:
    return KVBatchMeta(keys=[f"k{i}" for i in range(rows)], tags=[{"i": i} for i in range(rows)], partition_id="train",
                       fields=fields, extra_info={"temperature": 0.7, "global_batch_size": rows})


def test_the_schema_of_a_verl_batch_keeps_its_tensors_only():
    schema = extract_field_schema(verl_like_batch())
    assert set(schema) == {"input_ids", "advantages", "rewards", "raw_prompt", "data_source"}
    assert tf.tensor_fields(schema) == ["input_ids", "advantages", "rewards"]


def test_a_meta_without_fields_names_the_tensor_fields_and_keeps_the_rest():
    schema = extract_field_schema(verl_like_batch())
    asked = []
    meta = kv_meta()
    out = tf.with_tensor_fields(meta, lambda m: asked.append(m) or schema)
    assert asked == [meta]
    assert out.fields == ["input_ids", "advantages", "rewards"]
    assert (out.keys, out.tags, out.partition_id, out.extra_info) == (meta.keys, meta.tags, "train", meta.extra_info)
    assert meta.fields is None  # the caller's meta is not changed


def test_what_needs_no_narrowing_is_passed_on_unread():
    def no_read(_):
        raise AssertionError("the schema was read")

    empty = KVBatchMeta(keys=[], tags=[], partition_id="train")
    assert tf.with_tensor_fields(empty, no_read) is empty
    for other in ("x", 3, None, verl_like_batch()):
        assert tf.with_tensor_fields(other, no_read) is other
    tensors_only = extract_field_schema(verl_like_batch().exclude("raw_prompt", "data_source"))
    meta = kv_meta()
    assert tf.with_tensor_fields(meta, lambda _: tensors_only) is meta


def test_a_meta_that_names_its_fields_keeps_those_that_are_tensors_and_read():
    batch = verl_like_batch()
    asked = []

    def schema_of(meta):  # TransferQueue's schema of the fields a meta names
        asked.append(meta)
        return extract_field_schema(batch.select(*meta.fields))

    # what verl hands update_actor: the meta of its last write, naming every field the samples hold
    every = kv_meta(fields=["input_ids", "raw_prompt", "advantages", "data_source", "rewards"])
    out = tf.with_tensor_fields(every, schema_of)
    assert out.fields == ["input_ids", "advantages", "rewards"] and asked == [every]
    assert tf.with_tensor_fields(every, schema_of, read={"advantages", "input_ids", "old_log_probs"}).fields == [
        "input_ids", "advantages"]
    already = kv_meta(fields=["input_ids", "rewards"])
    assert tf.with_tensor_fields(already, schema_of) is already  # nothing to leave out: passed on as it is


def test_the_dispatch_narrows_then_calls_verls_and_collects_verls_way(monkeypatch):
    schema = extract_field_schema(verl_like_batch())
    monkeypatch.setattr(tf, "_schema_from_queue", lambda meta: schema)
    mode = tf.tensor_fields_dispatch("actor", "update_actor")
    verl_mode = make_nd_compute_dataproto_dispatch_fn("actor")
    assert mode["collect_fn"].func is verl_mode["collect_fn"].func and mode["collect_fn"].args == ("actor",)
    assert mode["dispatch_fn"].args[0].func is verl_mode["dispatch_fn"].func
    assert mode["dispatch_fn"].args[1] == "update_actor"
    seen = []
    group = object()
    monkeypatch.setattr(tf, "_read_by_method", {})  # no backend declared its fields
    out = tf._dispatch(lambda wg, *a, **k: seen.append((wg, a, k)) or "dispatched", "update_actor", group,
                       kv_meta(), 5, data=kv_meta(), other="y")
    assert out == "dispatched"
    (wg, args, kwargs), = seen
    assert wg is group and args[1] == 5 and kwargs["other"] == "y"
    assert args[0].fields == kwargs["data"].fields == ["input_ids", "advantages", "rewards"]


def test_the_worker_compute_methods_use_it():
    for name, mesh in (("compute_log_prob", "actor"), ("compute_ref_log_prob", "ref"), ("update_actor", "actor")):
        mode = getattr(getattr(RemoteActorRolloutRefWorker, name), MAGIC_ATTR)["dispatch_mode"]
        assert mode["dispatch_fn"].func is tf._dispatch, name
        assert mode["dispatch_fn"].args[1] == name
        assert mode["collect_fn"].args == (mesh,), name
    with pytest.raises(ValueError, match="generate"):
        tf.tensor_fields_dispatch("actor", "generate")


class _Declares:
    """A backend class that reads ``input_ids`` and ``advantages`` in its update, and declares nothing else."""

    @classmethod
    def tensor_fields_read(cls, method):
        return {"input_ids", "advantages"} if method == "update_actor" else None


def test_a_backend_that_declares_its_fields_gets_only_those_per_method(monkeypatch):
    schema = extract_field_schema(verl_like_batch())
    monkeypatch.setattr(tf, "_schema_from_queue", lambda meta: schema)
    monkeypatch.setattr(tf, "_read_by_method", {})
    assert tf.declare_fields_read(_Declares) == {"update_actor": frozenset({"input_ids", "advantages"})}
    sent = {}
    for method in COMPUTE_METHODS:
        tf._dispatch(lambda wg, meta, m=method: sent.setdefault(m, meta.fields), method, None, kv_meta())
    assert sent["update_actor"] == ["input_ids", "advantages"]  # in the schema's order; rewards not read
    assert sent["compute_log_prob"] == sent["compute_ref_log_prob"] == ["input_ids", "advantages", "rewards"]
    assert tf.declare_fields_read(object) == {} and tf._read_by_method == {}  # a class that declares nothing


def test_a_declaration_that_is_not_names_is_refused(monkeypatch):
    monkeypatch.setattr(tf, "_read_by_method", {})

    class Bad:
        @classmethod
        def tensor_fields_read(cls, method):
            return "input_ids"  # a string, not a collection of names

    with pytest.raises(TypeError, match=r"Bad.tensor_fields_read\('compute_log_prob'\)"):
        tf.declare_fields_read(Bad)


def test_the_arctic_adapter_declares_what_its_layout_and_update_read():
    from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
    from verl.workers.remote_client.arctic.layout import LAYOUT_KEYS

    assert ArcticRLClient.tensor_fields_read("compute_log_prob") == frozenset(LAYOUT_KEYS)
    assert ArcticRLClient.tensor_fields_read("update_actor") >= {"old_log_probs", "advantages", "response_mask",
                                                                 "ref_log_prob", "rollout_is_weights", "input_ids"}
    assert isinstance(ArcticRLClient, type) and issubclass(ArcticRLClient, ReadsTensorFields)


def test_the_tinker_adapter_declares_what_its_rows_and_update_read():
    from verl.workers.remote_client.tinker import batch as tb
    from verl.workers.remote_client.tinker.client import TinkerClient

    assert TinkerClient.tensor_fields_read("compute_ref_log_prob") == frozenset(tb.ROW_KEYS)
    assert TinkerClient.tensor_fields_read("update_actor") >= {"input_ids", "response_mask", "old_log_probs",
                                                                "advantages", "rollout_is_weights"}
    assert TinkerClient.tensor_fields_read("generate") is None
