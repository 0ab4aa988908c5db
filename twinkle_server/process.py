"""Start and stop a local `twinkle-server` process: for the demo, tests and benchmarks.

The process prints `listening on HOST:PORT` once bound (after `http listening on
HOST:PORT` when its HTTP front is on); `start_server` waits for that line and for the
standard health check to answer SERVING.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from twinkle_server.service.health import is_serving

STARTUP_TIMEOUT_S = 120


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str
    data_dir: Path
    log_path: Path
    http_address: str | None = None   # HOST:PORT of the HTTP front, when it was asked for

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        """Signal the server (SIGTERM drains) and wait for it to exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text()


def start_server(data_dir: Path, *extra: str, tls_ca: bytes | None = None,
                 http: bool = False) -> ServerProcess:
    """Run `twinkle-server serve --port 0` on `data_dir`; returns once it serves.

    `tls_ca`: PEM of the CA that signed the server's `--tls-cert`, for the health check of
    a TLS server. `http`: also serve the HTTP front on a free port (`--http-port 0`); its
    address is `ServerProcess.http_address`.
    """
    if http:
        extra = ("--http-port", "0", *extra)
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{time.time_ns()}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "twinkle_server.cli", "serve", "--port", "0",
         "--data-dir", str(data_dir), *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    address = None
    while time.monotonic() < deadline and address is None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log_path.read_text()}")
        match = re.search(r"^listening on (\S+)$", log_path.read_text(), re.M)
        address = match.group(1) if match else None
        time.sleep(0.1)
    if address is None:
        proc.kill()
        raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
    if not is_serving(address, tls_ca):
        proc.kill()
        raise RuntimeError(f"server is not SERVING:\n{log_path.read_text()}")
    match = re.search(r"^http listening on (\S+)$", log_path.read_text(), re.M)
    if http and match is None:
        proc.kill()
        raise RuntimeError(f"server has no HTTP front:\n{log_path.read_text()}")
    return ServerProcess(proc, address, data_dir, log_path,
                         match.group(1) if match else None)
