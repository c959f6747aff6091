"""What a new connection from kube-scheduler costs in CPU, the extender's and kube-scheduler's,
with the chart's own certificates: ECDSA P-256 keys (the chart's default) against RSA-2048 (what
helm's genCA and genSignedCert made before; still `scheduler.tls.keyAlgorithm: rsa`).

kube-scheduler's extender client keeps two idle connections, so most binds it sends (each waits
tens of milliseconds on the API server while other calls go on) open a connection of their own:
bench/throughput.py counts about 0.44 a pod at 5,000 nodes (its conns/pod). Each is a full TLS
handshake with client certificates, in which each side signs with its key and checks the other's
chain: the key type sets much of what it costs.

Both sides are the real ones: the certificates are rendered by the chart (`helm template`, helm
from tools/helm.mk); the extender's side is our HTTPS server, as `extender` serves it
(`serve.server_config` with `serve.tls_settings`: uvicorn, uvloop, OpenSSL, client certificates
required), in a process of its own answering every GET; the caller is tools/tlsdial (Go's
net/http and crypto/tls, configured as client-go's transport is for an extender's tlsConfig). For
each key type, tlsdial sends `--requests` requests each on a new connection, then as many on one
kept connection; the difference per request, in each process's CPU, is what a new connection
costs it: the TLS handshake, and the TCP connection's set-up and close. The server's CPU is read
(in nanoseconds, every thread's) at the moments tlsdial starts and ends its timed requests. A
first round is not counted (caches, the server's first connections); then key types alternate,
in the opposite order every other round, `--rounds` times; the medians are shown.

Run: uv run python bench/tls_handshake.py [--requests 300] [--rounds 3] [--conns-per-pod 0.44]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fleet import ROOT, machine_line, thread_cpu_seconds
from tests.e2e.chart import find, render
from tests.testbed.controlplane import find_built
from tests.testbed.process import free_port

SERVICE = "k8s-neuron-scheduler.kube-system.svc"  # the name kube-scheduler checks (serverName)
KEY_TYPES = ("ecdsa", "rsa")


def chart_certificates(algorithm: str, directory: Path) -> dict[str, Path]:
    """The chart's two Secrets for this key type, written out as the pods mount them."""
    docs = render({"scheduler": {"tls": {"keyAlgorithm": algorithm}}})
    files: dict[str, Path] = {}
    secrets = (
        ("k8s-neuron-scheduler-tls", "server"),
        ("k8s-neuron-scheduler-client-tls", "client"),
    )
    for secret, side in secrets:
        data = find(docs, "Secret", secret)["data"]
        for key in ("tls.crt", "tls.key", "ca.crt"):
            path = directory / algorithm / side / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(base64.b64decode(data[key]))
            files[f"{side} {key}"] = path
    return files


def serve(port: int, cert: Path, key: Path, client_ca: Path) -> None:
    """Our HTTPS server (`--serve`), answering every GET with 200."""
    import uvicorn
    import uvloop

    from neuron_scheduler.extender.serve import ExtenderOptions, server_config, tls_settings

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    options = ExtenderOptions(tls_cert=cert, tls_key=key, client_ca=client_ca)
    config = server_config(app, "127.0.0.1", port, "warning", **tls_settings(options))
    uvloop.run(uvicorn.Server(config).serve())


class Server:
    """A `--serve` process for one key type's certificates."""

    def __init__(self, files: dict[str, Path], log: Path) -> None:
        self.files = files
        self.port = free_port()
        args = ["--serve", "--port", str(self.port)]
        args += ["--cert", str(files["server tls.crt"]), "--key", str(files["server tls.key"])]
        args += ["--client-ca", str(files["server ca.crt"])]
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, __file__, *args], stdout=self.log, stderr=subprocess.STDOUT
        )

    def cpu_seconds(self) -> float:
        """The server's CPU so far, every thread's."""
        return thread_cpu_seconds(self.process.pid)

    def call(self, dial: Path, requests: int, new_connections: bool) -> tuple[float, float]:
        """(the server's CPU seconds, the caller's) for `requests` GETs, over the same span."""
        argv = [str(dial), "-url", f"https://127.0.0.1:{self.port}/", "-n", str(requests)]
        argv += ["-ca", str(self.files["client ca.crt"]), "-server-name", SERVICE]
        argv += ["-cert", str(self.files["client tls.crt"])]
        argv += ["-key", str(self.files["client tls.key"])]
        if new_connections:
            argv.append("-new-connections")
        with subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as dialing:
            assert dialing.stdin is not None and dialing.stdout is not None
            ready = dialing.stdout.readline().strip()
            before = self.cpu_seconds()
            if ready == "ready":
                dialing.stdin.write("go\n")
                dialing.stdin.flush()
            answer = dialing.stdout.readline()
            after = self.cpu_seconds()
            error = dialing.communicate(timeout=600)[1]
        if ready != "ready" or dialing.returncode:
            raise RuntimeError(f"tlsdial failed: {error.strip()}")
        return after - before, float(json.loads(answer)["cpu_seconds"])

    def wait_ready(self, dial: Path) -> None:
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {Path(self.log.name).read_text()}")
            try:
                self.call(dial, 1, True)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per key type, mode and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--conns-per-pod",
        type=float,
        default=0.44,
        help="new connections a pod (bench/throughput.py's conns/pod at 5,000 nodes)",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cert", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--key", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--client-ca", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.port, args.cert, args.key, args.client_ca)
        return 0
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    dial = find_built("TLSDIAL_BIN", "tlsdial-bin", ROOT)
    print(f"machine: {machine_line()}")
    # key type -> mode -> [(server ms, caller ms) a request, per round]
    figures: dict[str, dict[str, list[tuple[float, float]]]] = {
        kind: {"new": [], "kept": []} for kind in KEY_TYPES
    }
    with tempfile.TemporaryDirectory() as directory, contextlib.ExitStack() as servers_up:
        servers: dict[str, Server] = {}
        for kind in KEY_TYPES:
            files = chart_certificates(kind, Path(directory))
            servers[kind] = Server(files, Path(directory) / f"{kind}.log")
            servers_up.callback(servers[kind].stop)
        for server in servers.values():
            server.wait_ready(dial)
        for number in range(args.rounds + 1):  # round 0 is not counted
            order = KEY_TYPES if number % 2 else KEY_TYPES[::-1]
            for kind in order:
                for mode in ("new", "kept"):
                    used = servers[kind].call(dial, args.requests, mode == "new")
                    if number:
                        per = 1000 / args.requests
                        figures[kind][mode].append((used[0] * per, used[1] * per))
    print(
        f"\n{args.requests} GETs per key type and mode, {args.rounds} rounds (and one not "
        "counted); the chart's certificates; our HTTPS server, called by Go's crypto/tls as "
        "kube-scheduler calls it"
    )
    print(
        "| keys | extender, ms a request: on a new connection | on a kept one | a new connection | "
        "kube-scheduler's side: new | kept | a new connection | both, ms a pod |"
    )
    print("|---|---|---|---|---|---|---|---|")
    per_connection: dict[str, float] = {}  # both sides' CPU, ms
    for kind in KEY_TYPES:
        new, kept = (figures[kind][mode] for mode in ("new", "kept"))
        server_new, server_kept = (statistics.median(r[0] for r in rows) for rows in (new, kept))
        caller_new, caller_kept = (statistics.median(r[1] for r in rows) for rows in (new, kept))
        server, caller = server_new - server_kept, caller_new - caller_kept
        per_connection[kind] = server + caller
        print(
            f"| {kind} | {server_new:.3f} | {server_kept:.3f} | {server:.3f} | {caller_new:.3f} | "
            f"{caller_kept:.3f} | {caller:.3f} | {(server + caller) * args.conns_per_pod:.3f} |"
        )
    saved = (per_connection["rsa"] - per_connection["ecdsa"]) * args.conns_per_pod
    print(
        f"\nrsa against ecdsa, both sides: {per_connection['rsa']:.3f} against "
        f"{per_connection['ecdsa']:.3f} ms a new connection; at {args.conns_per_pod} new "
        f"connections a pod, {saved:.3f} ms a pod"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
