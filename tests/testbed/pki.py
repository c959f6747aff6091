"""Certificates for the extender's TLS as the chart sets it up: a CA, a serving certificate for
the extender (127.0.0.1 and its Service names), and a client certificate for my-scheduler.
Made with the openssl CLI, like the control plane's own keys."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVICE = "k8s-neuron-scheduler"
EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def openssl(*args: str) -> str:
    """The openssl CLI's output; RuntimeError with its message when it fails."""
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"openssl {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def create(cls, directory: Path, namespace: str = "kube-system") -> Pki:
        directory.mkdir(parents=True, exist_ok=True)
        ca, ca_key = directory / "ca.crt", directory / "ca.key"
        openssl(
            *("req", "-x509", *EC, "-keyout", str(ca_key), "-out", str(ca), "-days", "2"),
            *("-subj", "/CN=neuron-scheduler-test-ca"),
        )
        openssl("x509", "-in", str(ca), "-noout")  # fails early if openssl wrote nothing
        names = [
            "IP:127.0.0.1",
            "DNS:localhost",
            f"DNS:{SERVICE}",
            f"DNS:{SERVICE}.{namespace}.svc",
            f"DNS:{SERVICE}.{namespace}.svc.cluster.local",
        ]
        server = cls._signed(directory, "tls", "/CN=k8s-neuron-scheduler", ca, ca_key, names)
        client = cls._signed(directory, "client", "/CN=my-scheduler", ca, ca_key, [])
        return cls(ca, server[0], server[1], client[0], client[1])

    @staticmethod
    def _signed(
        directory: Path, name: str, subject: str, ca: Path, ca_key: Path, names: list[str]
    ) -> tuple[Path, Path]:
        cert, key, csr = (
            directory / f"{name}.crt",
            directory / f"{name}.key",
            directory / f"{name}.csr",
        )
        extensions = directory / f"{name}.ext"
        usage = "serverAuth" if names else "clientAuth"
        lines = [f"extendedKeyUsage={usage}"]
        if names:
            lines.append("subjectAltName=" + ",".join(names))
        extensions.write_text("\n".join(lines) + "\n")
        openssl("req", *EC, "-keyout", str(key), "-out", str(csr), "-subj", subject)
        openssl(
            *("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key)),
            *("-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(extensions)),
        )
        return cert, key

    def client_context(
        self, *, with_certificate: bool = True, check_hostname: bool = True
    ) -> ssl.SSLContext:
        """What a caller uses: trusts the extender's CA, presents my-scheduler's certificate.
        check_hostname False: the certificate names the Service, not 127.0.0.1 (kube-scheduler
        checks that name through tlsConfig.serverName); the chain is still checked."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = check_hostname
        if with_certificate:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context
