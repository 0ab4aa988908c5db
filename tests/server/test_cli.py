"""`twinkle-server`'s operator mistakes end in one line naming what to fix and exit
status 2, never a traceback; those `serve` can find are found before the model loads."""

from __future__ import annotations

import socket

import pytest

from twinkle_server import cli, server
from twinkle_server.config.flags import ServerConfig
from twinkle_server.server import config_problem


@pytest.fixture
def held_port():
    """A port some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_busy_grpc_or_http_port_is_refused_naming_the_flag(held_port, tmp_path):
    assert config_problem(ServerConfig(port=held_port, data_dir=tmp_path)).startswith(
        f"--port {held_port}: cannot listen on 127.0.0.1:{held_port}: ")
    assert config_problem(ServerConfig(http_port=held_port, data_dir=tmp_path)).startswith(
        f"--http-port {held_port}: cannot listen on 127.0.0.1:{held_port}: ")


def test_tls_files_that_cannot_be_read_or_loaded_are_refused_naming_the_flags(tmp_path):
    missing = tmp_path / "missing.pem"
    assert config_problem(ServerConfig(tls_cert=missing, tls_key=missing,
                                       data_dir=tmp_path)) == (
        f"--tls-cert {missing} --tls-key {missing}: cannot read {missing}: "
        "No such file or directory")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("garbage\n")
    assert config_problem(ServerConfig(tls_cert=garbage, tls_key=garbage,
                                       data_dir=tmp_path)).startswith(
        f"--tls-cert {garbage} --tls-key {garbage}: not a PEM certificate and its key")


def test_a_data_dir_that_cannot_be_made_is_refused_naming_the_flag(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert config_problem(ServerConfig(data_dir=afile / "sub")) == (
        f"--data-dir {afile / 'sub'}: {afile} is not a directory")


def test_an_unknown_log_level_is_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["serve", "--log-level", "verbose"])
    assert ended.value.code == 2
    assert "argument --log-level: invalid choice: 'verbose'" in capsys.readouterr().err


def test_a_bad_environment_value_is_one_line_in_serve_and_harmless_elsewhere(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TWINKLE_PORT", "abc")
    monkeypatch.setenv("TWINKLE_MAX_RANK", "x")
    assert cli.main(["keys", "create", "--tenant", "alice", "--data-dir", str(tmp_path)]) == 0
    assert cli.main(["keys", "list", "--data-dir", str(tmp_path)]) == 0
    assert cli.main(["runs", "list", "--data-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    assert cli.main(["serve", "--data-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "twinkle-server: TWINKLE_PORT='abc': give an integer (as --port)\n")


def test_a_bad_tenant_name_for_a_key_is_one_line(tmp_path, capsys):
    assert cli.main(["keys", "create", "--tenant", "bad name", "--data-dir",
                     str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "twinkle-server: --tenant 'bad name': use 1-64 letters, digits, '-' or '_'\n")


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_port_taken_after_the_check_is_one_line_naming_the_flag(
        flag, held_port, tiny_cache, monkeypatch, tmp_path, capsys):
    """Another program may take a port between `config_problem`'s check and the bind,
    once the model has loaded: the bind's failure is one line naming the flag, status 2."""
    monkeypatch.setattr(server, "config_problem", lambda *args, **kwargs: None)
    ports = {"--port": "0", "--http-port": "0", flag: str(held_port)}
    argv = ["serve", "--data-dir", str(tmp_path), *(x for p in ports.items() for x in p)]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"twinkle-server: {flag} {held_port}: cannot listen on ")


def test_an_unexpected_error_while_serving_keeps_its_traceback(monkeypatch, tmp_path):
    """Only the operator's mistakes and the machine's errors are one line: anything
    else (torch's RuntimeError at load, a bug) reaches the caller whole."""
    async def serve(config, *args, **kwargs):
        raise RuntimeError("an error nobody planned for")

    monkeypatch.setattr(server, "serve", serve)
    with pytest.raises(RuntimeError, match="nobody planned"):
        cli.main(["serve", "--port", "0", "--data-dir", str(tmp_path)])


