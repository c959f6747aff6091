"""Runs the extender (`python bench/h2serve.py -m neuron_scheduler extender ...`) with its HTTPS
port serving HTTP/2 as well (uvicorn's zttp protocol, ALPN h2): configuration `ours-h2` of
bench/throughput.py, next to `null-h2`. zttp is a dev dependency only, for these benchmarks; the
extender itself has no such option."""

from __future__ import annotations

import runpy
import sys
from typing import Any

import uvicorn

from neuron_scheduler.extender import serve

plain = serve.server_config


def with_http2(app: Any, host: str, port: int, log_level: str, **tls: Any) -> uvicorn.Config:
    config = plain(app, host, port, log_level, **tls)
    if tls:  # the verbs' port, not the probes'
        config.http, config.http2 = "zttp", True
    return config


if __name__ == "__main__":
    if sys.argv[1:2] != ["-m"] or len(sys.argv) < 3:
        raise SystemExit(__doc__)
    serve.server_config = with_http2
    sys.argv = [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
