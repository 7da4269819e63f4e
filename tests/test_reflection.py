"""gRPC server reflection on the coordinator's port (what grpcurl and grpcui read), behind the
job's token; none on the plaintext health port; and the wire contract's .proto in the package."""

from __future__ import annotations

import os
import subprocess
from importlib import resources

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from tests.support.procs import ROOT

TOKEN = "refl-t0ken"
COORDINATOR = "gridcomm.v1.Coordinator"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
CALL_S = 10.0


class _Bearer(grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every streaming call, as grpcurl's -H does."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_stream_stream(self, continuation, details, request_iterator):
        metadata = list(details.metadata or ()) + [("authorization", f"Bearer {self._token}")]
        return continuation(details._replace(metadata=metadata), request_iterator)


def _channel(port: int, token: str | None) -> grpc.Channel:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=CALL_S)
    return channel if token is None else grpc.intercept_channel(channel, _Bearer(token))


def _ask(channel: grpc.Channel, *requests: reflection_pb2.ServerReflectionRequest) -> list:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    return list(stub.ServerReflectionInfo(iter(requests), timeout=CALL_S))


@pytest.mark.timeout(60)
def test_reflection_lists_and_describes_the_coordinator_with_the_token(coordinator_factory):
    server = coordinator_factory(2, token=TOKEN)
    with _channel(server.port, TOKEN) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert set(database.get_services()) == {COORDINATOR, HEALTH, REFLECTION}
        pool = descriptor_pool.DescriptorPool(database)
        service = pool.FindServiceByName(COORDINATOR)
        served = [m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods]
        assert [m.name for m in service.methods] == served
        assert {"Join", "Barrier", "Set", "Get", "Session"} <= set(served)
        join = service.methods_by_name["Join"]
        assert (join.input_type.full_name, join.output_type.full_name) == ("gridcomm.v1.JoinRequest",
                                                                          "gridcomm.v1.JoinResponse")
        # The fields a hand-written call (grpcurl -d) needs, as the stubs have them.
        assert ([f.name for f in join.input_type.fields]
                == [f.name for f in pb.JoinRequest.DESCRIPTOR.fields])
        assert service.file.name == "gridcomm/_proto/coordinator.proto"
        assert pool.FindServiceByName(HEALTH).methods_by_name["Check"].output_type.full_name == \
            "grpc.health.v1.HealthCheckResponse"
        # Several questions on one stream, as grpcurl asks them.
        answers = _ask(channel,
                       reflection_pb2.ServerReflectionRequest(list_services=""),
                       reflection_pb2.ServerReflectionRequest(file_by_filename="gridcomm/_proto/coordinator.proto"))
        assert [a.WhichOneof("message_response") for a in answers] == ["list_services_response",
                                                                      "file_descriptor_response"]
    # The port still serves the job.
    client_ok(server.port)


def client_ok(port: int) -> None:
    """The coordinator still answers its own service (Status, with the token)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=CALL_S,
                                                        metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert reply.world_size >= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, "not-the-token"], ids=["missing", "wrong"])
def test_reflection_without_the_token_is_refused(coordinator_factory, token):
    server = coordinator_factory(2, token=TOKEN)
    with _channel(server.port, token) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _ask(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        how = "missing" if token is None else "wrong"
        assert f"ServerReflectionInfo refused: the token is {how}" in refused.value.details()
        assert "GRIDCOMM_TOKEN" in refused.value.details()
        # The token is checked on the headers, before the body is read: bytes that are no
        # request are refused for the token too.
        raw = channel.stream_stream(f"/{REFLECTION}/ServerReflectionInfo",
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as unread:
            list(raw(iter([b"\xff" * 4096]), timeout=CALL_S))
        assert unread.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The database raises the same error rather than listing nothing.
        with pytest.raises(grpc.RpcError) as listed:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert listed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client_ok(server.port)


@pytest.mark.timeout(60)
def test_health_is_checkable_through_reflection_without_the_token(coordinator_factory):
    """As grpcurl does for `grpc.health.v1.Health/Check` without -H: it asks reflection for the
    service's schema, builds the request from it and calls Check. Health needs no token, so its
    schema needs none; anything else reflection says still does."""
    from google.protobuf import message_factory

    server = coordinator_factory(2, token=TOKEN)
    with _channel(server.port, None) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        service = pool.FindServiceByName(HEALTH)
        check = service.FindMethodByName("Check")
        request_class = message_factory.GetMessageClass(check.input_type)
        response_class = message_factory.GetMessageClass(check.output_type)
        call = channel.unary_unary(f"/{HEALTH}/Check", request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=response_class.FromString)
        reply = call(request_class(service=""), timeout=CALL_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # The rest of reflection, in a new call or after a health request on the same one: refused.
        for requests in ([reflection_pb2.ServerReflectionRequest(file_containing_symbol=COORDINATOR)],
                         [reflection_pb2.ServerReflectionRequest(file_containing_symbol=HEALTH),
                          reflection_pb2.ServerReflectionRequest(list_services="")],
                         [reflection_pb2.ServerReflectionRequest(file_by_filename="gridcomm/_proto/coordinator.proto")]):
            with pytest.raises(grpc.RpcError) as refused:
                _ask(channel, *requests)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, requests
            assert "ServerReflectionInfo refused: the token is missing" in refused.value.details()
    client_ok(server.port)


@pytest.mark.timeout(60)
def test_reflection_describes_only_what_the_port_serves(coordinator_factory):
    """A file in the process's default pool that the port does not serve (in rank 0 that is the
    user's own protos) is not found; a file the port serves is."""
    from google.protobuf import timestamp_pb2  # the coordinator runs in this process: now in its default pool
    assert descriptor_pool.Default().FindFileByName(timestamp_pb2.DESCRIPTOR.name)
    server = coordinator_factory(1, token=TOKEN)
    with _channel(server.port, TOKEN) as channel:
        answers = _ask(channel,
                       reflection_pb2.ServerReflectionRequest(file_containing_symbol="google.protobuf.Timestamp"),
                       reflection_pb2.ServerReflectionRequest(file_by_filename="google/protobuf/timestamp.proto"),
                       reflection_pb2.ServerReflectionRequest(file_containing_symbol="no.such.Symbol"),
                       reflection_pb2.ServerReflectionRequest(file_containing_symbol="gridcomm.v1.BarrierRequest"))
        kinds = [a.WhichOneof("message_response") for a in answers]
        assert kinds == ["error_response", "error_response", "error_response", "file_descriptor_response"]
        assert {a.error_response.error_code for a in answers[:3]} == {grpc.StatusCode.NOT_FOUND.value[0]}


@pytest.mark.timeout(60)
def test_an_undecodable_reflection_request_is_refused_and_the_coordinator_serves_on(coordinator_factory):
    server = coordinator_factory(1, token=TOKEN)
    with _channel(server.port, TOKEN) as channel:
        raw = channel.stream_stream(f"/{REFLECTION}/ServerReflectionInfo",
                                    request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as refused:
            list(raw(iter([b"\xff\xff\xff\xff"]), timeout=CALL_S))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ServerReflectionRequest" in refused.value.details()
        # The same stream type still answers, and so does the job's service.
        assert _ask(channel, reflection_pb2.ServerReflectionRequest(list_services=""))[0].list_services_response.service
    client_ok(server.port)


@pytest.mark.timeout(60)
def test_the_plaintext_health_port_offers_health_only(coordinator_factory):
    """The health port needs no token (kubelet sends none), so it carries nothing but
    grpc.health.v1: a reflection call there is UNIMPLEMENTED, with or without the token."""
    server = coordinator_factory(1, token=TOKEN, health_port=0)
    assert server.health_port
    for token in (None, TOKEN):
        with _channel(server.health_port, token) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                _ask(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_S)
            assert check.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(120)
def test_reflection_over_tls_with_call_credentials(coordinator_factory, pki):
    """With TLS the token rides as gRPC's own access-token call credentials (what grpcurl's
    -H 'authorization: Bearer ...' sends too)."""
    if subprocess.run(["which", "openssl"], capture_output=True).returncode != 0:
        pytest.skip("needs the openssl command to make test certificates")
    from gridcomm import _config
    from tests.support.tls import tls_env
    tls = _config.tls(tls_env(pki))
    server = coordinator_factory(1, tls=tls, token=TOKEN)
    with open(pki["ca"] + ".pem", "rb") as ca:
        transport = grpc.ssl_channel_credentials(root_certificates=ca.read())
    for call, code in ((grpc.access_token_call_credentials(TOKEN), None),
                       (None, grpc.StatusCode.UNAUTHENTICATED)):
        credentials = transport if call is None else grpc.composite_channel_credentials(transport, call)
        with grpc.secure_channel(f"localhost:{server.port}", credentials) as channel:
            if code is None:
                assert COORDINATOR in ProtoReflectionDescriptorDatabase(channel).get_services()
            else:
                with pytest.raises(grpc.RpcError) as refused:
                    _ask(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
                assert refused.value.code() == code


def _packaged_proto() -> str:
    return resources.files("gridcomm._proto").joinpath("coordinator.proto").read_text(encoding="utf-8")


def test_the_installed_package_carries_the_proto():
    """An operator without the source tree finds the contract (with its comments) beside the
    stubs, at the path the served descriptor names: grpcurl -import-path SITE -proto
    gridcomm/_proto/coordinator.proto."""
    text = _packaged_proto()
    assert "package gridcomm.v1;" in text and "service Coordinator {" in text
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        assert f"rpc {method.name}(" in text, f"the packaged .proto lacks {method.name}"
    for message in pb.DESCRIPTOR.message_types_by_name:
        assert f"message {message} " in text, f"the packaged .proto lacks message {message}"


def test_the_packaged_proto_is_the_source_contract():
    """The package's copy is protos/ (the one protoc reads); `make proto` refreshes it."""
    source = os.path.join(ROOT, "protos", "gridcomm", "_proto", "coordinator.proto")
    if not os.path.exists(source):
        pytest.skip("no source tree (an installed gridcomm)")
    with open(source, encoding="utf-8") as f:
        assert _packaged_proto() == f.read(), "gridcomm/_proto/coordinator.proto differs from protos/: run `make proto`"
