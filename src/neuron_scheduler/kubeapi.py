"""A small Kubernetes API client on aiohttp: config loading, JSON requests, watch streams."""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import yaml

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class ConfigError(ValueError):
    """No usable way to reach the API server; the message says what was tried."""


class ApiError(Exception):
    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        self.status = status
        self.reason = ""
        message = body.decode(errors="replace")[:500]
        try:
            status_object = msgspec.json.decode(body)
            if isinstance(status_object, dict):
                message = str(status_object.get("message", message))
                self.reason = str(status_object.get("reason", ""))
        except msgspec.DecodeError:
            pass
        self.message = message
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


@dataclass(frozen=True, slots=True)
class KubeConfig:
    server: str
    token: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    insecure: bool = False

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
    # ssl wants files; kubeconfigs often embed base64 data instead.
    with tempfile.NamedTemporaryFile(
        prefix="neuron-scheduler-", suffix=suffix, delete=False
    ) as handle:
        handle.write(base64.b64decode(data))
    return Path(handle.name)


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


class KubeAPI:
    """JSON over HTTPS to one API server, sharing a connection pool across callers."""

    TOKEN_REFRESH_SECONDS = 60.0  # bound service-account tokens rotate; re-read the file

    def __init__(self, config: KubeConfig, *, timeout: float = 10.0) -> None:
        self.config = config
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = config.token
        self._token_read = 0.0

    async def __aenter__(self) -> KubeAPI:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        file = self.config.token_file
        if file is not None and time.monotonic() - self._token_read > self.TOKEN_REFRESH_SECONDS:
            self._token = file.read_text().strip()
            self._token_read = time.monotonic()
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context(), limit=64)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> bytes:
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = msgspec.json.encode(body)
        async with self.session().request(
            method,
            self.config.server + path,
            params=params,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self._timeout),
        ) as response:
            payload = await response.read()
            if response.status >= 400:
                raise ApiError(method, path, response.status, payload)
            return payload

    async def stream(
        self, path: str, params: dict[str, str], *, idle_timeout: float
    ) -> AsyncIterator[bytes]:
        """Lines of a watch response; raises on HTTP errors or when nothing arrives in time."""
        async with self.session().get(
            self.config.server + path,
            params=params,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self._timeout, sock_read=idle_timeout
            ),
        ) as response:
            if response.status >= 400:
                raise ApiError("GET", path, response.status, await response.read())
            async for line in response.content:
                if line.strip():
                    yield line

    # --- the calls the extender makes --------------------------------------------------------

    async def patch_pod_annotations(
        self, namespace: str, name: str, uid: str, values: dict[str, str | None]
    ) -> None:
        """A JSON merge patch of only these annotation keys (None deletes one). The uid in the
        body is a precondition: a pod recreated under the same name is never touched."""
        await self.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{name}",
            body={"metadata": {"uid": uid, "annotations": values}},
            content_type="application/merge-patch+json",
        )

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        await self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods/{name}/binding",
            body={
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace, "uid": uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            },
        )

    async def get(self, path: str) -> bytes:
        return await self.request("GET", path)

    async def create_event(
        self, namespace: str, name: str, uid: str, reason: str, message: str, warning: bool
    ) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        await self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body={
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"generateName": f"{name}.", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": name,
                    "namespace": namespace,
                    "uid": uid,
                },
                "reason": reason,
                "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": "neuron-scheduler"},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
        )
