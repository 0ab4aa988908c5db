"""Session trace exports (Tinker's `RestClient.export_session_trace`): a tenant's session's
trace (`runtime.traces`) written to a file in the data dir and reached through a signed,
expiring URL (`runtime.signed_urls`), as external weights are; another tenant's session is
not found. Files are replaced by each export of their session and cleared at start:
traces live in memory, so no file outlives the process that recorded it. The operator's
own way in, without a tenant's key, is `twinkle-server sessions trace` (`cli`), which reads
`Core.traces` through the operator route.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from twinkle_server.engine import replace_file
from twinkle_server.engine.errors import NotFound
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.signed_urls import SignedPath, Signer, load_secret

TRACE_DIR = "session-traces"
TRACE_PREFIX = "/api/v1/session_traces"
"""Where the HTTP front serves exported traces (`trace_path`)."""
OPERATOR_PREFIX = "/api/v1/operator/session_traces"
"""Where it serves any session's trace to a URL signed with the data dir's own secret
(`operator_path`): what `twinkle-server sessions trace` signs, having read the data dir."""


def trace_path(session_id: str) -> str:
    return f"{TRACE_PREFIX}/{session_id}.json"


def operator_path(session_id: str) -> str:
    return f"{OPERATOR_PREFIX}/{session_id}"


class TraceExports:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.signer = Signer(load_secret(core.store.data_dir))
        self.root = core.store.data_dir / TRACE_DIR
        shutil.rmtree(self.root, ignore_errors=True)

    def trace(self, tenant: str, session_id: str) -> bytes:
        """The trace of one of `tenant`'s sessions, open or closed (empty when none of
        its ops is remembered)."""
        if self.core.store.get_session(tenant, session_id) is None:
            raise NotFound(f"session_id: no session {session_id!r}")
        return self.core.traces.export(session_id)

    def export(self, tenant: str, session_id: str) -> SignedPath:
        """Write the session's trace now and sign its download for `tenant`."""
        data = self.trace(tenant, session_id)
        self.root.mkdir(parents=True, exist_ok=True)
        replace_file(self.root / f"{session_id}.json", data)
        return self.signer.sign(trace_path(session_id), reader=tenant)

    def for_operator(self, session_id: str, expires: str | None,
                     signature: str | None) -> bytes:
        """Any session's trace, to a URL the operator signed (raises `BadSignature`, or
        `NotFound` where this server remembers no op of it)."""
        self.signer.check(operator_path(session_id), expires, signature)
        if session_id not in self.core.traces:
            raise NotFound(f"session {session_id!r}: no op of it since the server started "
                           "(or forgotten: a server keeps its last "
                           f"{self.core.traces.sessions} sessions' traces)")
        return self.core.traces.export(session_id)

    def open(self, session_id: str, expires: str | None, signature: str | None,
             reader: str | None) -> Path:
        """The exported trace a signed URL names (raises `BadSignature` or `NotFound`)."""
        self.signer.check(trace_path(session_id), expires, signature, reader=reader)
        path = self.root / f"{session_id}.json"
        if not path.is_file():
            raise NotFound(f"session trace {session_id}: not exported since the server "
                           "started; export it again")
        return path
