"""One server owns a data dir and a port: a second one is refused at start, in one line,
before it can take connections or clean the first one's files; `keys create` will not
leave an open server open beside a key; the commands that only read a data dir never
make one."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from twinkle_server import cli
from twinkle_server.runtime.core import SNAPSHOT_DIR
from twinkle_server.runtime.trace_exports import TRACE_DIR
from twinkle_server.store import Store
from twinkle_server.store.lock import DataDirLock, holder, keys_settled
from twinkle_wire._proto.twinkle.v1 import runs_pb2

from ..service.harness import Client, start_server, twinkle_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("open-server"))
    yield proc
    proc.stop()


def _refused(data_dir, *extra: str) -> str:
    """The log of a server refused at start; fails (stopping it) if it started."""
    try:
        started = start_server(data_dir, *extra)
    except RuntimeError as refused:
        log = str(refused)
    else:
        started.stop()
        pytest.fail(f"a second server started: {started.address}")
    assert log.startswith("server exited 2")
    assert "Traceback" not in log
    return log


def test_a_second_server_on_a_live_servers_port_is_refused_naming_the_port(
        open_server, tmp_path):
    port = open_server.address.rsplit(":", 1)[1]
    log = _refused(tmp_path / "second", "--port", port)
    assert f"twinkle-server: --port {port}: cannot listen on" in log


def test_a_second_server_on_a_live_servers_data_dir_is_refused_and_leaves_its_files(
        open_server, tmp_path):
    data_dir = open_server.data_dir
    kept = [data_dir / SNAPSHOT_DIR / "sess-x" / "adapter_model.safetensors",
            data_dir / TRACE_DIR / "sess-x.json"]
    for path in kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("the first server's")
    served = (data_dir / "served.json").read_text()
    log = _refused(data_dir, "--http-port", "0")
    assert (f"twinkle-server: data dir {data_dir} is in use by pid {open_server.proc.pid}"
            in log)
    assert all(path.read_text() == "the first server's" for path in kept)
    assert (data_dir / "served.json").read_text() == served
    client = Client(open_server.address)
    client.call(client.runs.ListRuns, runs_pb2.ListRunsRequest())   # the first serves on


def test_keys_create_beside_an_open_server_is_refused_naming_its_pid(open_server):
    data_dir = str(open_server.data_dir)
    out = twinkle_server("keys", "create", "--tenant", "alice", "--data-dir", data_dir)
    assert out.returncode == 2
    assert f"(pid {open_server.proc.pid}) runs open" in out.stderr
    assert "stop it, create the key, then start it again" in out.stderr
    listed = twinkle_server("keys", "list", "--data-dir", data_dir)
    assert "alice" not in listed.stdout


def test_a_key_created_beside_a_keyed_server_works_at_once(tmp_path, tiny_cache):
    data_dir = tmp_path / "keyed"
    assert twinkle_server("keys", "create", "--tenant", "alice",
                          "--data-dir", str(data_dir)).returncode == 0
    proc = start_server(data_dir)
    try:
        out = twinkle_server("keys", "create", "--tenant", "bob", "--data-dir", str(data_dir))
        assert out.returncode == 0, out.stderr
        bob = Client(proc.address, out.stdout.strip().splitlines()[-1])
        bob.call(bob.runs.ListRuns, runs_pb2.ListRunsRequest())
        stranger = Client(proc.address, "tml-nobody")
        with pytest.raises(grpc.RpcError) as refused:
            stranger.call(stranger.runs.ListRuns, runs_pb2.ListRunsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        proc.stop()


def test_keys_create_waits_for_a_starting_servers_decision_then_honours_it(tmp_path, capsys):
    """A server decides once, at its start, whether it serves open; a `keys create` in
    that instant waits for the decision (held for milliseconds), then refuses an open
    one. Unguarded, it could check before an open decision and write after it."""
    lock = DataDirLock.take(tmp_path)              # a server started, not decided yet
    try:
        with ThreadPoolExecutor(1) as pool:
            with keys_settled(tmp_path):           # ... and deciding now
                creating = pool.submit(cli.main, [
                    "keys", "create", "--tenant", "alice", "--data-dir", str(tmp_path)])
                time.sleep(0.5)
                assert not creating.done(), "keys create ran in the middle of the decision"
                lock.record(open_mode=not Store(tmp_path).has_keys())    # no key: open
            assert creating.result(timeout=60) == 2
    finally:
        lock.release()
    assert "runs open, with no API keys" in capsys.readouterr().err
    assert not Store(tmp_path).has_keys()


def test_a_key_made_before_a_starting_servers_decision_makes_it_keyed(tmp_path):
    """Between taking the data dir and reading the keys a server has decided nothing: a
    key made then is one its decision sees, so it is not refused."""
    lock = DataDirLock.take(tmp_path)
    try:
        assert holder(tmp_path).open_mode is None
        assert cli.main(["keys", "create", "--tenant", "bob", "--data-dir",
                         str(tmp_path)]) == 0
        with keys_settled(tmp_path):
            lock.record(open_mode=not Store(tmp_path).has_keys())
        assert holder(tmp_path).open_mode is False
    finally:
        lock.release()


@pytest.mark.parametrize("command", [("runs", "list"), ("runs", "show", "run-x"),
                                     ("keys", "list"), ("keys", "revoke", "k1"),
                                     ("sessions", "trace", "sess-x")])
def test_a_command_that_reads_a_data_dir_refuses_one_that_does_not_exist(command, tmp_path):
    missing = tmp_path / "misspelt"
    out = twinkle_server(*command, "--data-dir", str(missing))
    assert out.returncode == 2
    assert out.stderr.strip() == (f"twinkle-server: --data-dir {missing}: no Twinkle data "
                                  "dir there (no twinkle.db); give the one the server was "
                                  "started with")
    assert not missing.exists()


def test_adapters_import_refuses_a_tenant_that_is_no_name(tmp_path):
    data_dir = tmp_path / "data"
    out = twinkle_server("adapters", "import", str(tmp_path), "--tenant", "../../escaped",
                         "--data-dir", str(data_dir))
    assert out.returncode == 2
    assert out.stderr.strip() == ("twinkle-server: --tenant '../../escaped': use 1-64 "
                                  "letters, digits, '-' or '_'")
    assert not (tmp_path.parent / "escaped").exists()



def test_an_ipv6_loopback_host_serves_grpc_and_http_at_bracketed_addresses(tmp_path):
    """`--host ::1` passes the loopback rule; gRPC was then given `::1:0`, which it could
    not bind, after the model had loaded. The printed addresses are bracketed, as gRPC
    targets and URLs write an IPv6 literal."""
    import httpx

    proc = start_server(tmp_path, "--host", "::1", "--http-port", "0")
    try:
        assert proc.address.startswith("[::1]:")           # start_server saw it SERVING
        assert proc.http_address.startswith("[::1]:")
        reply = httpx.get(f"http://{proc.http_address}/api/v1/healthz", timeout=30)
        assert reply.json() == {"status": "ok"}
    finally:
        proc.stop()
