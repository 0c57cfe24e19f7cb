"""The kubelet's PodResources API v1: api.proto and the code protoc generates from it (scripts/gen-podresources).

Importing api_pb2/api_pb2_grpc needs grpcio and protobuf (the extra gpuwatch[kubernetes]); this package itself
imports without them.
"""
