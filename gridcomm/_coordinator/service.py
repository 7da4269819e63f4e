"""The Coordinator gRPC service on the coordinator's port: each RPC's handler (the token checked on
the call's headers, the request read and decoded, the servicer's operation run, a refusal answered
as its status), the Session stream's, and server reflection under the same token rules."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from gridcomm._coordinator.answers import Abort, refuse
from gridcomm._coordinator.servicer import Servicer
from gridcomm._coordinator.session import ServerSession
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._runtime.admission import Admission
from gridcomm._wire import SERVICE_NAME, UNDECODABLE, decoder

#: Each servicer's admission (its calls mark their connections authenticated there).
ADMISSIONS: weakref.WeakKeyDictionary[Servicer, Admission] = weakref.WeakKeyDictionary()


async def _admit(servicer: Servicer, context: grpc.aio.ServicerContext, name: str) -> None:
    """Checks the call's token on its headers; a refused call is answered (and this raises). An
    admitted call's connection is authenticated from then on (see gridcomm._runtime.admission)."""
    servicer.metrics.watch_call(context, name)  # counted by method and code when the call ends
    try:
        servicer.authenticate(context, name)
    except Exception as exc:  # noqa: BLE001 - refused with a status, never a crash
        await refuse(context, name, exc)
    admission = ADMISSIONS.get(servicer)
    if admission is not None:
        admission.admitted(context.peer())


async def _read_request(context: grpc.aio.ServicerContext, name: str) -> Any:
    request = await context.read()
    if request is grpc.aio.EOF:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {name} call carried no request.")
    if request is UNDECODABLE:
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {name} request body is not a valid gridcomm.v1 message of its type.")
    return request


def _unary(servicer: Servicer, name: str, operation: Callable[[Servicer, Any, float | None], Awaitable[Any]]) -> Any:
    async def handle(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await _admit(servicer, context, name)
        try:
            return await operation(servicer, await _read_request(context, name), servicer.deadline_of(context))
        except Exception as exc:  # noqa: BLE001 - the coordinator must survive any request
            await refuse(context, name, exc)
    return handle


def _handlers(servicer: Servicer) -> dict[str, Any]:
    """Each RPC's handler. Why every one takes a streaming request (the same bytes on the wire as a
    unary call): the token is checked on the call's headers before any request message is read.
    gRPC reads and parses a unary request whole before its handler runs, so without a token 12
    concurrent 79 MiB Sets took a coordinator to +2.3 GB before each was refused."""

    plain_status = _unary(servicer, "Status", Servicer.status)

    async def status(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        # The latest refused joins ride in the trailers (for `gridcomm status`; no proto change).
        context.set_trailing_metadata(servicer.metrics.refusals_trailer())
        return await plain_status(request_iterator, context)

    async def session(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """Operations on one stream; each answers as its unary RPC would (see the proto)."""
        await _admit(servicer, context, "Session")
        await ServerSession(servicer, context).serve()

    return {
        "Join": _unary(servicer, "Join", Servicer.join),
        "Set": _unary(servicer, "Set", Servicer.set),
        "Get": _unary(servicer, "Get", Servicer.get),
        "Barrier": _unary(servicer, "Barrier", Servicer.barrier),
        "Heartbeat": _unary(servicer, "Heartbeat", Servicer.heartbeat),
        "ReportFailure": _unary(servicer, "ReportFailure", Servicer.report_failure),
        "Leave": _unary(servicer, "Leave", Servicer.leave),
        "Status": status,
        "Session": session,
        "Add": _unary(servicer, "Add", Servicer.add),
        "CompareSet": _unary(servicer, "CompareSet", Servicer.compare_set),
        "DeleteKey": _unary(servicer, "DeleteKey", Servicer.delete_key),
        "Keys": _unary(servicer, "Keys", Servicer.keys),
    }


def register_service(servicer: Servicer, server: grpc.aio.Server) -> None:
    """Registers the Coordinator service like the generated helper, but with the handlers above
    and deserializers that turn an undecodable body into a sentinel refused with
    INVALID_ARGUMENT (gRPC's own answer would be UNKNOWN); server reflection beside it."""
    handlers = _handlers(servicer)
    methods = {}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        make = grpc.stream_stream_rpc_method_handler if method.server_streaming else grpc.stream_unary_rpc_method_handler
        methods[method.name] = make(handlers[method.name],
                                    request_deserializer=decoder(getattr(pb, method.input_type.name)),
                                    response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))
    _register_reflection(servicer, server)


#: The services the coordinator's port answers, as reflection lists them.
SERVED = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)


@functools.lru_cache(maxsize=1)
def _reflection_pool() -> descriptor_pool.DescriptorPool:
    """A descriptor pool of the served services' files (and their imports) only. Why not the
    default pool, as grpcio-reflection would use: it holds every .proto the process imported (in
    rank 0, the user's program's own), and reflection would describe them on this port too."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:  # a pool takes a file only after its imports
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.AddSerializedFile(proto.SerializeToString())
        added.add(file.name)

    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        add(file)
    return pool


def _register_reflection(servicer: Servicer, server: grpc.aio.Server) -> None:
    """Adds gRPC server reflection (``grpc.reflection.v1alpha``, the one grpcio-reflection
    implements; grpcurl and grpcui fall back to it from v1) under the token rules of every other
    coordinator call: a call without the token is refused UNAUTHENTICATED, counted and logged like
    the others, at its first request that asks for more than grpc.health.v1's schema (health
    itself needs no token). The answers
    are grpcio-reflection's, from :func:`_reflection_pool`. The plaintext health port gets none:
    it needs no token (kubelet sends none), so it carries grpc.health.v1 and nothing else."""
    answers = reflection.aio.ReflectionServicer(SERVED, pool=_reflection_pool())
    name = "ServerReflectionInfo"

    async def info(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        servicer.metrics.watch_call(context, name)
        # Without the token, requests about grpc.health.v1 alone are answered (health needs no
        # token, and grpcurl asks reflection for Health's schema before its Check); any other
        # request, or bytes that are none, is refused UNAUTHENTICATED as every other call is.
        open_to_all = not servicer.has_token(context)

        async def requests() -> Any:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    return
                if open_to_all and (request is UNDECODABLE or not _about_health(request)):
                    servicer.authenticate(context, name)  # raises: noted and refused like any call
                if request is UNDECODABLE:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a {name} request body is not a valid grpc.reflection.v1alpha.ServerReflectionRequest.")
                yield request

        try:
            async for response in answers.ServerReflectionInfo(requests(), context):
                await context.write(response)
        except Exception as exc:  # noqa: BLE001 - the coordinator must survive any request
            await refuse(context, name, exc)

    handler = grpc.stream_stream_rpc_method_handler(
        info, request_deserializer=decoder(reflection_pb2.ServerReflectionRequest),
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {name: handler}),))


def _about_health(request: reflection_pb2.ServerReflectionRequest) -> bool:
    """A reflection request for grpc.health.v1's schema only (what a health check by hand needs)."""
    asked = request.WhichOneof("message_request")
    if asked == "file_containing_symbol":
        return request.file_containing_symbol.startswith(health.SERVICE_NAME.rsplit(".", 1)[0] + ".")
    return asked == "file_by_filename" and request.file_by_filename == health_pb2.DESCRIPTOR.name

