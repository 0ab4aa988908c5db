"""The standard gRPC health check, asked from outside: is a server at an address SERVING?"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, tls_ca: bytes | None = None, timeout_s: float = 30) -> bool:
    """Whether the server at `address` answers the health check with SERVING.

    `tls_ca`: PEM of the CA that signed a TLS server's certificate.
    """
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca))
               if tls_ca is not None else grpc.insecure_channel(address))
    with channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=timeout_s)
    return status.status == health_pb2.HealthCheckResponse.SERVING
