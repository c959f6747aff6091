"""Where the API server is and how to authenticate: a kubeconfig file, or the pod's service
account. Also which namespace this process runs in, and where kubectl would look for a
kubeconfig (for the commands a person runs, and the kubectl plugin)."""

from __future__ import annotations

import atexit
import base64
import contextlib
import dataclasses
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ConfigError(ValueError):
    """No usable way to reach the API server; the message says what was tried."""


@dataclass(frozen=True, slots=True)
class KubeConfig:
    server: str
    token: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    insecure: bool = False
    namespace: str = ""  # the current context's, for commands that default to it (as kubectl)

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.client_cert and self.client_key:
            context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


def _materialize(data: str, suffix: str) -> Path:
    # ssl wants files; kubeconfigs often embed base64 data instead. Removed at exit: one may be
    # a private key.
    with tempfile.NamedTemporaryFile(
        prefix="neuron-scheduler-", suffix=suffix, delete=False
    ) as handle:
        atexit.register(_remove, handle.name)
        handle.write(base64.b64decode(data))
    return Path(handle.name)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def load_kubeconfig(path: Path) -> KubeConfig:
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read kubeconfig {path}: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"kubeconfig {path} is not valid YAML: {error}") from error
    try:
        contexts = {c["name"]: c["context"] for c in document.get("contexts") or []}
        context = contexts[document["current-context"]]
        clusters = {c["name"]: c["cluster"] for c in document.get("clusters") or []}
        cluster = clusters[context["cluster"]]
        users = {u["name"]: u.get("user") or {} for u in document.get("users") or []}
        user = users.get(context.get("user", ""), {})
        base = path.parent

        def file(key: str, data_key: str, holder: dict[str, Any], suffix: str) -> Path | None:
            if holder.get(data_key):
                return _materialize(str(holder[data_key]), suffix)
            if holder.get(key):
                return base / str(holder[key])
            return None

        return KubeConfig(
            server=cluster["server"].rstrip("/"),
            token=user.get("token"),
            token_file=base / user["tokenFile"] if user.get("tokenFile") else None,
            ca_file=file("certificate-authority", "certificate-authority-data", cluster, ".crt"),
            client_cert=file("client-certificate", "client-certificate-data", user, ".crt"),
            client_key=file("client-key", "client-key-data", user, ".key"),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            namespace=str(context.get("namespace") or ""),
        )
    except (KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"kubeconfig {path}: missing or malformed entry {error}") from error


def in_cluster_config() -> KubeConfig:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    token = SERVICE_ACCOUNT_DIR / "token"
    if not host or not token.exists():
        raise ConfigError(
            "no --kubeconfig given and not running in a pod (KUBERNETES_SERVICE_HOST or the "
            f"service account token at {token} is missing)"
        )
    if ":" in host:
        host = f"[{host}]"
    return KubeConfig(
        server=f"https://{host}:{port}", token_file=token, ca_file=SERVICE_ACCOUNT_DIR / "ca.crt"
    )


def load_config(kubeconfig: Path | None) -> KubeConfig:
    if kubeconfig is not None:
        return load_kubeconfig(kubeconfig)
    env = os.environ.get("KUBECONFIG")
    if env and Path(env).exists() and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        return load_kubeconfig(Path(env))
    return in_cluster_config()


def kubectl_config(kubeconfig: Path | None) -> KubeConfig:
    """The API server kubectl would talk to: `--kubeconfig`, else the first file in $KUBECONFIG
    that exists (a list, as kubectl takes it; files are not merged), else ~/.kube/config, else
    the pod's service account. A kubectl plugin is run with kubectl's environment, so
    `kubectl neuron ...` reaches the same cluster as `kubectl get pods`."""
    if kubeconfig is not None:
        return load_kubeconfig(kubeconfig)
    for entry in os.environ.get("KUBECONFIG", "").split(os.pathsep):
        if entry and Path(entry).expanduser().is_file():
            return load_kubeconfig(Path(entry).expanduser())
    home = Path("~/.kube/config").expanduser()
    if home.is_file():
        return load_kubeconfig(home)
    try:
        config = in_cluster_config()
    except ConfigError:
        raise ConfigError(
            "no kubeconfig: give --kubeconfig, set KUBECONFIG, create ~/.kube/config, or run "
            "in a pod with a service account"
        ) from None
    return dataclasses.replace(config, namespace=own_namespace("default"))


def own_namespace(fallback: str) -> str:
    """The namespace this process runs in: $POD_NAMESPACE (downward API), else the service
    account's namespace file, else `fallback` (outside a pod)."""
    env = os.environ.get("POD_NAMESPACE")
    if env:
        return env
    try:
        return (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip() or fallback
    except OSError:
        return fallback
