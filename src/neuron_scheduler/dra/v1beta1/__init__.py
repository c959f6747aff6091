"""Generated gRPC stubs for kubelet's DRA plugin API v1beta1 (service `v1beta1.DRAPlugin`; from
proto/, by proto/generate.py). Same messages as v1 without `share_id`."""
