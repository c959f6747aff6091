"""Generated gRPC stubs for kubelet's plugin registration API (proto package
`pluginregistration`; from proto/, by proto/generate.py)."""
