"""A run survives ``kill -9`` of the server: restore from the last checkpoint + replay of the journal.

The real reference server is killed (SIGKILL) and started again on the same port and checkpoint
root by a supervisor thread, three times in one run of 6 optimizer steps (checkpoints every 2):

1. between steps, while only a rollout-replica-like client (attached, generation only) is calling:
   the training client's watcher restores the jobs, the other client adopts them;
2. during a step, before the ``/forward-backward`` of step 4 (the journal holds step 3: its
   ``/forward-backward`` and its ``/step``);
3. during a step, *after* the server applied ``/step`` 5 but before its answer left (the proxy
   reads the answer, kills the server, drops the answer).

The final weights (``/forward`` log-probs of a fixed batch) must equal those of the same run
without faults bit for bit, and the server's step counter must be 6: no step applied twice, none
lost. A restore gives the sampler the weights of the step it had, not the newer ones the training
job reaches. The journal's own rules (bound, overflow, reset) are unit-tested at the bottom.
"""

from __future__ import annotations

import logging

import pytest
import requests
import torch

from tests.support.reliability import DropProxy, Supervisor, client_config, final_logprobs, train_batch
from tests.support.server import running_server
from verl.workers.remote_client.arctic.arctic_rl import ArcticRLClient
from verl.workers.remote_client.arctic.journal import CheckpointRef, UpdateJournal


@pytest.mark.slow
def test_kill9_between_and_during_steps_is_restored_exactly(tmp_path_factory, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="verl.workers.remote_client")
    with running_server(tmp_path_factory.mktemp("server")) as srv, DropProxy(srv.port) as proxy:
        supervisor = Supervisor(srv)
        cfg = client_config(tiny_model_dir, proxy.url, recovery={"checkpoint_every_n_steps": 2, "watch_interval_s": 1.0,
                                                        "wait_s": 600})
        client = ArcticRLClient.from_config(cfg)
        follower = None
        try:
            start = client.save_checkpoint(step=0, path="start")["path"]
            for i in range(3):  # the undisturbed reference: 6 steps
                client.update_actor(train_batch(i))
            reference = final_logprobs(client)
            assert client.step == 6
            client.load_checkpoint(path=start)
            assert client.step == 0

            client.update_actor(train_batch(0))  # steps 1, 2 -> recovery checkpoint of step 2
            first_instance = client.reconnect_handle()["instance_id"]

            # 1) kill -9 between steps; the first caller is a generation-only client (a rollout replica)
            follower = ArcticRLClient.from_config(client_config(tiny_model_dir, srv.url),
                                                  handle=dict(client.reconnect_handle(), url=srv.url))
            supervisor.kill_and_restart()
            results = follower.generate([[5, 6, 7]], {"max_tokens": 2, "temperature": 0.0})
            assert len(results) == 1 and results[0].prompt_len == 3
            # adopted what the trainer restored (a new server numbers its jobs from 1 again)
            assert follower.job_ids == client.job_ids
            restored = client.reconnect_handle()["instance_id"]
            assert follower.reconnect_handle()["instance_id"] == restored != first_instance
            assert client.reliability_stats()["recovery/restores"] == 1
            assert follower.reliability_stats()["recovery/adoptions"] == 1

            # 2) kill -9 before the /forward-backward of step 4 (one per mini-batch)
            proxy.counts.clear()
            proxy.drop("POST", "/forward-backward", 2, "drop_request", callback=supervisor.kill_and_restart)
            client.update_actor(train_batch(1))  # steps 3, 4 -> recovery checkpoint of step 4
            assert client.step == 4

            # 3) kill -9 after the server applied /step 5, before its answer reached the client
            proxy.counts.clear()
            proxy.rules.clear()
            proxy.drop("POST", "/step", 1, "drop_response", callback=supervisor.kill_and_restart)
            client.update_actor(train_batch(2))  # steps 5, 6
            assert len(proxy.fired) == 2 and supervisor.kills == 3

            got = final_logprobs(client)
            assert torch.equal(got, reference), (got - reference).abs().max()
            assert client.step == 6
            info = requests.get(f"{srv.url}/job/{client.job_ids['training']}", timeout=30).json()
            assert info["global_step"] == 6 and info["pending_forward_backward"] == 0
            stats = client.reliability_stats()
            assert stats["recovery/restores"] == 3
            # 3 for the training job, and 3 for the sampler: its last weight sync was the load of `start` (step 0),
            # rebuilt at each restore from the journal part the recovery checkpoints replaced (kept from `start` on:
            # no weight sync since)
            assert stats["recovery/checkpoints_loaded"] == 3 + 3
            assert "could not rebuild" not in caplog.text and "the restore cannot rebuild" not in caplog.text
            assert caplog.text.count("the restored sampler has the weights of step 0 again") == 3
            # replayed: nothing after checkpoint 2; step 3's /forward-backward and /step (2); step 5's
            # /forward-backward (1)
            assert stats["recovery/journal_replayed"] == 0 + 2 + 1
            assert "restoring the training state" in caplog.text and "LOST" not in caplog.text
            status = requests.get(srv.url + "/status", timeout=30).json()["jobs"]
            assert sorted(int(k) for k in status) == sorted(client.job_ids.values())
            assert {v["client_tag"] for v in status.values()} == {client.client_tag}
        finally:
            if follower is not None:
                follower.destroy()  # attached: destroys nothing
            client.destroy()
            supervisor.wait()
        assert requests.get(srv.url + "/status", timeout=30).json()["jobs"] == {}


@pytest.mark.slow
@pytest.mark.parametrize("answer_of_step", ["answered", "lost"])
def test_kill9_right_after_a_step_before_the_recovery_checkpoint(tmp_path_factory, tiny_model_dir, answer_of_step):
    """The server dies after ``/step`` 2 was applied, while the client reads ``GET /job`` -- the read
    that precedes a recovery checkpoint (``answered``), or the read that recovers the metrics of a
    ``/step`` whose answer was lost (``lost``). Neither read may end the run: the client restores,
    and the state equals the undisturbed run's."""
    with running_server(tmp_path_factory.mktemp("server")) as srv, DropProxy(srv.port) as proxy:
        supervisor = Supervisor(srv)
        # no watcher: the failed call itself must notice the restart; no recovery.checkpoint_path, so
        # the directory comes from the job's own info (GET /job) at the first due checkpoint
        # a lost /step answer is settled by the job's counter only when ids are not replayed (vendor mode)
        retry = {"server_idempotency": "off"} if answer_of_step == "lost" else {}
        cfg = client_config(tiny_model_dir, proxy.url, recovery={"checkpoint_every_n_steps": 2, "watch_interval_s": 0,
                                                        "wait_s": 600}, retry=retry)
        client = ArcticRLClient.from_config(cfg)
        try:
            start = client.save_checkpoint(step=0, path="start")["path"]
            job = f"/job/{client.job_ids['training']}"
            if answer_of_step == "lost":  # the answer of /step 2 is dropped; the counter read shows it applied
                proxy.drop("POST", "/step", 2, "drop_response")
                proxy.drop("GET", job, 2, "drop_request", callback=supervisor.kill_and_restart)
            else:  # the first due checkpoint reads the job's directory once per client
                proxy.drop("GET", job, 1, "drop_request", callback=supervisor.kill_and_restart)
            client.update_actor(train_batch(0))  # steps 1, 2
            assert supervisor.kills == 1 and len(proxy.fired) == len(proxy.rules)
            assert client.step == 2
            got = final_logprobs(client)
            info = requests.get(f"{srv.url}/job/{client.job_ids['training']}", timeout=30).json()
            assert info["global_step"] == 2 and info["pending_forward_backward"] == 0
            stats = client.reliability_stats()
            assert stats["recovery/restores"] == 1
            assert stats["recovery/checkpoints_saved"] == 1  # the due checkpoint, taken after the restore
            assert stats.get("recovery/ambiguous_applied", 0) == (answer_of_step == "lost")

            client.load_checkpoint(path=start)  # the undisturbed reference
            client.update_actor(train_batch(0))
            reference = final_logprobs(client)
            assert torch.equal(got, reference), (got - reference).abs().max()
        finally:
            client.destroy()
            supervisor.wait()


def _sampler_logprobs(client) -> torch.Tensor:
    """The sampler's log-probs of its greedy answers to two fixed prompts: they name the weights it has."""
    results = client.generate([[5, 6, 7], [8, 9]], {"max_tokens": 6, "temperature": 0.0, "logprobs": 1})
    return torch.tensor([x for r in results for x in r.logprobs])


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_every", [100, 4], ids=["journal_since_start", "checkpoint_after_sampler_step"])
def test_a_restore_gives_the_sampler_the_weights_of_the_step_it_had(tmp_path_factory, tiny_model_dir,
                                                                    checkpoint_every):
    """The server dies after the steps 3-4 were applied but before their weight sync (in the asynchronous mode the
    rollout servers keep generating then, tagged with version 2). The restore syncs the new sampler when the
    training job passes step 2, so it samples with step 2's weights, as the tags say; the training job still
    reaches step 4, and the next weight sync brings step 4's weights. Step 2 comes from the journal since the
    start, or (a recovery checkpoint taken at step 4, before the weight sync) from the part of the journal that
    checkpoint replaced."""
    with running_server(tmp_path_factory.mktemp("server")) as srv:
        supervisor = Supervisor(srv)
        cfg = client_config(tiny_model_dir, srv.url, recovery={"checkpoint_every_n_steps": checkpoint_every,
                                                              "watch_interval_s": 0, "wait_s": 600})
        client = ArcticRLClient.from_config(cfg)
        try:
            client.save_checkpoint(step=0, path="start")  # the base the restore loads
            client.update_actor(train_batch(0))  # steps 1, 2
            client.update_weights()
            at_step_2 = _sampler_logprobs(client)
            client.update_actor(train_batch(1))  # steps 3, 4: no weight sync yet
            supervisor.kill_and_restart()
            supervisor.wait()

            restored = _sampler_logprobs(client)  # the lost jobs are noticed here and restored
            stats = client.reliability_stats()
            assert stats["recovery/restores"] == 1
            assert stats.get("recovery/checkpoints_saved", 0) == (checkpoint_every == 4)
            assert client.step == 4
            info = requests.get(f"{srv.url}/job/{client.job_ids['training']}", timeout=30).json()
            assert info["global_step"] == 4
            assert torch.allclose(restored, at_step_2, atol=1e-5), (restored - at_step_2).abs().max()

            client.update_weights()
            at_step_4 = _sampler_logprobs(client)
            assert (at_step_4 - at_step_2).abs().max() > 1e-3  # the weights of the two steps are told apart
        finally:
            client.destroy()
            supervisor.wait()


# ------------------------------------------------------------------------------------------------ journal


def test_journal_records_in_order_and_resets_at_checkpoints():
    journal = UpdateJournal(max_bytes=1000)
    assert journal.complete and journal.base is None and journal.steps == 0
    journal.record("/forward-backward", b"x" * 100, "application/octet-stream", is_step=False)
    journal.record("/step", {}, None, is_step=True)
    assert [e.path for e in journal.entries] == ["/forward-backward", "/step"] and journal.steps == 1
    assert journal.nbytes == 100 + 64
    journal.reset(CheckpointRef("/ckpt/checkpoint-1", 1))
    assert journal.entries == [] and journal.nbytes == 0 and journal.base.step == 1
    assert journal.previous is None  # a load (the default): what led here is gone


def test_journal_keeps_what_a_save_replaced_until_the_next_weight_sync():
    journal = UpdateJournal(max_bytes=1000)
    journal.reset(CheckpointRef("/ckpt/a", 2))
    journal.record("/forward-backward", b"x" * 10, "application/octet-stream", is_step=False)
    journal.record("/step", {}, None, is_step=True)
    replaced = list(journal.entries)
    journal.reset(CheckpointRef("/ckpt/b", 3), keep_previous=True)  # a save
    assert journal.previous == (CheckpointRef("/ckpt/a", 2), replaced) and journal.entries == []
    journal.record("/step", {}, None, is_step=True)
    journal.reset(CheckpointRef("/ckpt/c", 4), keep_previous=True)  # another save, no weight sync between them
    assert journal.previous[0] == CheckpointRef("/ckpt/a", 2)  # still from where the sampler's step is
    assert [e.path for e in journal.previous[1]] == ["/forward-backward", "/step", "/step"]
    journal.drop_previous()  # the weight sync after it
    assert journal.previous is None
    journal.record("/step", {}, None, is_step=True)
    journal.overflowed = True  # an incomplete journal cannot rebuild anything: not kept
    journal.reset(CheckpointRef("/ckpt/d", 5), keep_previous=True)
    assert journal.previous is None


def test_journal_overflow_is_loud_and_counts_the_steps_it_cannot_replay(caplog):
    journal = UpdateJournal(max_bytes=250)
    journal.record("/forward-backward", b"x" * 100, "application/octet-stream", is_step=False)
    journal.record("/step", {}, None, is_step=True)
    with caplog.at_level(logging.ERROR):
        journal.record("/forward-backward", b"x" * 100, "application/octet-stream", is_step=False)
    assert not journal.complete and journal.entries == [] and journal.nbytes == 0
    assert "journal is full" in caplog.text and "LOSES the steps" in caplog.text
    journal.record("/step", {}, None, is_step=True)
    assert journal.steps == 2  # both steps since the base are gone
    journal.reset(None)
    assert journal.complete and journal.steps == 0


def test_a_client_attached_mid_run_cannot_restore_until_it_checkpoints():
    journal = UpdateJournal(max_bytes=1000)
    journal.start_unknown(step=7)
    assert not journal.complete and journal.base is None  # the next step boundary checkpoints early
    journal.reset(CheckpointRef("/ckpt/checkpoint-8", 8))
    assert journal.complete


def test_derived_sampling_seeds_repeat_across_runs_and_differ_across_samples():
    from verl.workers.remote_client.arctic.generation import SeedDeriver

    first, second = SeedDeriver(7), SeedDeriver(7)
    run1 = [first([[5, 6]]), first([[5, 6]]), first([[9]])]
    run2 = [second([[5, 6]]), second([[5, 6]]), second([[9]])]
    assert run1 == run2  # a re-run (or a re-sent call) samples the same tokens
    assert len(set(run1)) == 3  # GRPO's n samples of one prompt differ
    assert SeedDeriver(8)([[5, 6]]) != run1[0] and all(0 <= s < 2**63 for s in run1)


def test_copies_of_a_prompt_never_share_a_derived_seed():
    from verl.workers.remote_client.arctic.generation import unique_layers

    rows = [[1, 2], [1, 2], [3], [1, 2], [3], [4]]
    layers = unique_layers(rows)
    assert layers == [[0, 2, 5], [1, 4], [3]]  # layer k: the k-th copy of each prompt, in order
    assert sorted(i for layer in layers for i in layer) == list(range(len(rows)))
    assert all(len({tuple(rows[i]) for i in layer}) == len(layer) for layer in layers)
    assert unique_layers([[5], [6]]) == [[0, 1]]  # no repeat: one call, as before
