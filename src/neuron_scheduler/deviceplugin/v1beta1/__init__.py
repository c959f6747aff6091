"""Generated gRPC stubs for the kubelet device plugin API v1beta1 (from proto/, by
proto/generate.py). Import `api_pb2` for messages and `api_pb2_grpc` for stubs and servicers."""
