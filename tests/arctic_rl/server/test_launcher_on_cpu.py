"""The reference server's launcher (``arctic_rl.server.launcher``) when a start goes wrong.

Stand-in executables (a shell script in place of ``python``) play the server, so these run in
milliseconds; the launcher starting, restarting and stopping the real server is exercised by every
test that uses ``tests.support.server.running_server`` or the adapter's ``LocalServer``.
"""

from __future__ import annotations

import os
import pickle

import pytest

from arctic_rl.server.launcher import ServerExited, ServerNotHealthy, ServerProcess


def fake_python(tmp_path, body: str) -> str:
    script = tmp_path / "fake_python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def test_a_server_that_exits_is_reported_with_its_code_and_log(tmp_path):
    server = ServerProcess(tmp_path / "root", python=fake_python(tmp_path, 'echo "cannot load model $@"; exit 3'))
    with pytest.raises(ServerExited) as err:
        server.start()
    assert err.value.returncode == 3 and not server.alive
    assert "cannot load model -m arctic_rl.server --host 127.0.0.1" in err.value.log_tail
    assert err.value.log_path == tmp_path / "root" / f"arctic_server-{server.port}.log"
    assert str(err.value.log_path) in str(err.value)


def test_a_server_that_never_answers_is_stopped(tmp_path):
    pid_file = tmp_path / "pid"
    python = fake_python(tmp_path, f'echo $$ > {pid_file}; echo "warming up"; exec sleep 60')
    server = ServerProcess(tmp_path / "root", python=python, startup_timeout_s=1.0)
    with pytest.raises(ServerNotHealthy) as err:
        server.start()
    assert isinstance(err.value, TimeoutError) and err.value.timeout_s == 1.0 and "warming up" in err.value.log_tail
    with pytest.raises(ProcessLookupError):  # terminated and reaped, not leaked
        os.kill(int(pid_file.read_text()), 0)


def test_a_picked_port_taken_before_the_bind_is_picked_again(tmp_path):
    tries = tmp_path / "tries"
    python = fake_python(tmp_path, f'echo "$6" >> {tries}; echo "[Errno 98] address already in use"; exit 1')
    server = ServerProcess(tmp_path / "root", python=python)
    with pytest.raises(ServerExited):
        server.start()
    assert len(tries.read_text().split()) == 3  # three ports tried, then the failure is reported


def test_a_given_port_is_not_changed(tmp_path):
    tries = tmp_path / "tries"
    python = fake_python(tmp_path, f'echo "$6" >> {tries}; echo "[Errno 98] address already in use"; exit 1')
    server = ServerProcess(tmp_path / "root", port=45678, python=python)
    with pytest.raises(ServerExited):
        server.start()
    assert tries.read_text().split() == ["45678"] and server.port == 45678


def test_the_token_goes_through_the_environment_not_the_command_line(tmp_path):
    python = fake_python(tmp_path, 'echo "token=$ARCTIC_RL_SERVER_TOKEN"; exit 3')
    server = ServerProcess(tmp_path / "root", token="s3cret", python=python, exit_with_parent=False)
    assert "s3cret" not in " ".join(server.command()) and "--exit-with-parent" not in server.command()
    assert server.headers == {"Authorization": "Bearer s3cret"}
    with pytest.raises(ServerExited) as err:
        server.start()
    assert "token=s3cret" in err.value.log_tail


@pytest.mark.parametrize("error", [
    ServerExited("exited", None, "tail", 3),
    ServerNotHealthy("no answer", None, "tail", 2.5),
], ids=lambda e: type(e).__name__)
def test_start_errors_pickle_intact(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and back.__dict__ == error.__dict__
