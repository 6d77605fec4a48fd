"""``remote_backend.server.local``'s server options: each reaches the server it starts as the flag of that name.

``in_flight_on_weight_load`` (what a weight sync does with the ``/generate`` calls in flight), ``warm_up`` (the
jobs' compile warm-up before step 1), ``training_stream`` (one CUDA stream for the training and log_prob jobs) and
``release_at_sync`` (the allocator's unused blocks released after a weight sync) and ``vllm_engine_process`` (the
vLLM engine core in the server's process or its own): null keeps the server's own
default and adds no flag; a value becomes the flag and the server's command line reads it back; anything else is
refused before a server starts, naming the key, the allowed values and what was received.
"""

from __future__ import annotations

import pytest

from arctic_rl.server.__main__ import parse_args
from verl.remote_backend.errors import RemoteBackendConfigError
from verl.workers.remote_client.arctic.arctic_config import ArcticConfig
from verl.workers.remote_client.arctic.local_server import _extra_args


def _local(**options):
    return ArcticConfig.from_dict({"server": {"local": options}}).server.local


def test_null_keeps_the_servers_defaults():
    args = parse_args(list(_extra_args(_local())))
    assert _extra_args(_local()) == ()
    assert (args.in_flight_on_weight_load, args.warm_up, args.training_stream, args.release_at_sync,
            args.vllm_engine_process) == ("wait", "auto", "off", "on", "same")


@pytest.mark.parametrize(("key", "value", "flag"), [
    ("in_flight_on_weight_load", "restart", "--in-flight-on-weight-load"),
    ("in_flight_on_weight_load", "wait", "--in-flight-on-weight-load"),
    ("warm_up", "off", "--warm-up"),
    ("warm_up", "on", "--warm-up"),
    ("training_stream", "on", "--training-stream"),
    ("training_stream", "off", "--training-stream"),
    ("release_at_sync", "off", "--release-at-sync"),
    ("release_at_sync", "on", "--release-at-sync"),
    ("vllm_engine_process", "own", "--vllm-engine-process"),
    ("vllm_engine_process", "same", "--vllm-engine-process"),
])
def test_a_value_becomes_the_servers_flag(key, value, flag):
    extra = _extra_args(_local(**{key: value}))
    assert extra == (flag, value)
    assert getattr(parse_args(list(extra)), key) == value


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("in_flight_on_weight_load", "abort", r"\['wait', 'restart'\]"),
    ("warm_up", "yes", r"\['auto', 'on', 'off'\]"),
    ("training_stream", "true", r"\['on', 'off'\]"),
    ("release_at_sync", "yes", r"\['on', 'off'\]"),
    ("vllm_engine_process", "separate", r"\['same', 'own'\]"),
])
def test_a_bad_value_is_refused_naming_the_key_the_choices_and_the_value(key, value, allowed):
    with pytest.raises(RemoteBackendConfigError, match=rf"server\.local\.{key}(.|\n)*{allowed}(.|\n)*{value}"):
        _local(**{key: value})
