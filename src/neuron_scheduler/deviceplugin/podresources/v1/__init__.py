"""Generated gRPC stubs for kubelet's pod resources API v1 (from proto/, by proto/generate.py).
Import `api_pb2` for messages and `api_pb2_grpc` for the PodResourcesLister stub."""
