"""Generated gRPC stubs for kubelet's DRA plugin API v1 (service `v1.DRAPlugin`; from proto/, by
proto/generate.py)."""
