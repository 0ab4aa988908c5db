"""The SDK's `RestClient` calls this client does not serve: sessions, samplers, identity
and billing. The gRPC front has no call for them, so each raises a NotFoundError naming
itself, why, and what to do instead (`unserved`); `RestClient` takes them from
`UnservedCalls`, so its signatures stay the SDK's."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from tinker import types

from tinker_compat.futures import APIFuture, deprecated
from tinker_compat.rest_weights import deprecated_async
from twinkle_client.connection import Connection

AccessScope = Literal["owned", "accessible"]
OVER_HTTP = ("the gRPC front has no call for it; the stock tinker SDK gets it from the "
             "server's HTTP front (twinkle-server --http-port)")
"""Why, and what to do instead, for a call only the server's HTTP front has a route for."""


def unserved(conn: Connection, method: str, why: str) -> Exception:
    """The error of a Tinker SDK method this client does not serve: a NotFoundError (as
    the server's HTTP front answers the stock SDK for a route it lacks) naming the method,
    why, and what to do instead."""
    return conn.error_factory("not_found", f"{method}: not served by this server; {why}",
                              method)


class UnservedCalls:
    """The SDK's session, sampler, identity and billing calls, each refused by name."""

    _conn: Connection


    def get_session(self, session_id: str, access_scope: AccessScope = "owned"
                    ) -> APIFuture[types.GetSessionResponse]:
        """Not served over gRPC (raises NotFoundError); the HTTP front serves it."""
        raise unserved(self._conn, "get_session", OVER_HTTP)

    @deprecated(deprecated_async("get_session"))
    async def get_session_async(self, session_id: str, access_scope: AccessScope = "owned"
                                ) -> types.GetSessionResponse:
        """Deprecated: as `get_session`, not served over gRPC."""
        return await self.get_session(session_id, access_scope)

    def list_sessions(self, limit: int = 20, offset: int = 0,
                      access_scope: AccessScope = "owned"
                      ) -> APIFuture[types.ListSessionsResponse]:
        """Not served over gRPC (raises NotFoundError); the HTTP front serves it."""
        raise unserved(self._conn, "list_sessions", OVER_HTTP)

    @deprecated(deprecated_async("list_sessions"))
    async def list_sessions_async(self, limit: int = 20, offset: int = 0,
                                  access_scope: AccessScope = "owned"
                                  ) -> types.ListSessionsResponse:
        """Deprecated: as `list_sessions`, not served over gRPC."""
        return await self.list_sessions(limit, offset, access_scope)

    def search_sessions(self, request: types.SessionSearchRequest
                        ) -> APIFuture[types.SessionSearchResponse]:
        """Not served (raises NotFoundError): the server has no session search."""
        raise unserved(self._conn, "search_sessions",
                       "it has no session search; list sessions with list_sessions (the stock "
                       "tinker SDK, through the server's HTTP front)")

    def assign_session_project(self, session_id: str, project_id: str) -> APIFuture[None]:
        """Not served (raises NotFoundError): the server has tenants, not projects."""
        raise unserved(self._conn, "assign_session_project",
                       "it has tenants, not projects")

    @deprecated(deprecated_async("assign_session_project"))
    async def assign_session_project_async(self, session_id: str, project_id: str) -> None:
        """Deprecated: as `assign_session_project`, not served."""
        return await self.assign_session_project(session_id, project_id)

    def export_session_trace(self, session_id: str) -> APIFuture[str]:
        """Not served over gRPC (raises NotFoundError); the HTTP front serves it."""
        raise unserved(self._conn, "export_session_trace", OVER_HTTP)

    @deprecated(deprecated_async("export_session_trace"))
    async def export_session_trace_async(self, session_id: str) -> str:
        """Deprecated: as `export_session_trace`, not served over gRPC."""
        return await self.export_session_trace(session_id)

    def whoami(self) -> APIFuture[types.WhoamiResponse]:
        """Not served (raises NotFoundError): the server issues no identity tokens."""
        raise unserved(self._conn, "whoami",
                       "it issues no identity tokens: requests authenticate with the API key "
                       "itself, and the tenant is the key's")

    def get_sampler(self, sampler_id: str) -> APIFuture[types.GetSamplerResponse]:
        """Not served over gRPC (raises NotFoundError); the HTTP front serves it."""
        raise unserved(self._conn, "get_sampler", OVER_HTTP)

    @deprecated(deprecated_async("get_sampler"))
    async def get_sampler_async(self, sampler_id: str) -> types.GetSamplerResponse:
        """Deprecated: as `get_sampler`, not served over gRPC."""
        return await self.get_sampler(sampler_id)

    def get_billing_usage(self, starting_on: datetime | str, ending_before: datetime | str
                          ) -> APIFuture[types.BillingUsageResponse]:
        """Not served (raises NotFoundError): the server bills nothing."""
        raise unserved(self._conn, "get_billing_usage", "it bills nothing")

    @deprecated(deprecated_async("get_billing_usage"))
    async def get_billing_usage_async(self, starting_on: datetime | str,
                                      ending_before: datetime | str
                                      ) -> types.BillingUsageResponse:
        """Deprecated: as `get_billing_usage`, not served."""
        return await self.get_billing_usage(starting_on, ending_before)

    def get_current_checkpoint_storage_usage(self, project_id: str | None = None
                                             ) -> APIFuture[
                                                 types.CurrentCheckpointStorageUsageResponse]:
        """Not served (raises NotFoundError): the server bills no storage."""
        raise unserved(self._conn, "get_current_checkpoint_storage_usage",
                       "it bills no storage; list_user_checkpoints gives each checkpoint's "
                       "size_bytes")

    @deprecated(deprecated_async("get_current_checkpoint_storage_usage"))
    async def get_current_checkpoint_storage_usage_async(
            self, project_id: str | None = None) -> types.CurrentCheckpointStorageUsageResponse:
        """Deprecated: as `get_current_checkpoint_storage_usage`, not served."""
        return await self.get_current_checkpoint_storage_usage(project_id)
