"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` (grpcurl,
Postman and most current tools try it first) and the older ``grpc.reflection.v1alpha``.

grpcio-reflection only ships v1alpha. The two protocols are the same messages under another
package, so one servicer answers both: the v1 method is served with the v1alpha message classes
(identical wire format), and a v1 copy of the descriptor is added to the pool so that tools can
describe the v1 service they see listed.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) listing ``service_names`` plus themselves."""
    _add_v1_descriptor()
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
    )
    handlers = {"ServerReflectionInfo": v1}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),)
    )


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return  # added already (a second server in this process), or by another library
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(fdp)
    old = f".{fdp.package}."
    new = f".{V1_PACKAGE}."
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = V1_PACKAGE
    fdp.ClearField("options")

    def rename(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
        for m in messages:
            for f in m.field:
                if f.type_name.startswith(old):  # assigning "" would mark a scalar as typed
                    f.type_name = new + f.type_name[len(old) :]
            rename(m.nested_type)

    rename(fdp.message_type)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    pool.AddSerializedFile(fdp.SerializeToString())
