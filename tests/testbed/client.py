"""A minimal Kubernetes REST client and kubeconfig writer (stdlib only)."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class KubeError(Exception):
    """A non-2xx answer from the API server, with the status and response body."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.body = body
        try:
            detail = json.loads(body)
        except ValueError:
            detail = None
        message = detail.get("message", body) if isinstance(detail, dict) else body
        self.reason: str = detail.get("reason", "") if isinstance(detail, dict) else ""
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {message}".strip())


def ssl_context(cafile: Path | None) -> ssl.SSLContext:
    """Verify against cafile, or skip verification when there is none yet."""
    if cafile is not None:
        return ssl.create_default_context(cafile=str(cafile))
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def opener(cafile: Path | None) -> urllib.request.OpenerDirector:
    """An opener that never uses *_proxy variables: everything here is on loopback."""
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ssl_context(cafile))
    )


class KubeClient:
    """JSON over HTTPS with a bearer token; enough for tests to create objects."""

    def __init__(
        self, server_url: str, token: str, *, cafile: Path | None = None, timeout: float = 10.0
    ) -> None:
        self.server_url = server_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._opener = opener(cafile)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        """Send one request; return the decoded JSON answer (None if empty).

        body may be a JSON-able object, or str/bytes sent as is. For patches pass
        content_type "application/merge-patch+json",
        "application/strategic-merge-patch+json" or "application/apply-patch+yaml".
        Raises KubeError on any non-2xx status.
        """
        data: bytes | None
        if body is None:
            data = None
        elif isinstance(body, bytes):
            data = body
        elif isinstance(body, str):
            data = body.encode()
        else:
            data = json.dumps(body).encode()
        req = urllib.request.Request(self.server_url + path, data=data, method=method.upper())
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with self._opener.open(req, timeout=self.timeout) as resp:
                raw: bytes = resp.read()
        except urllib.error.HTTPError as e:
            raise KubeError(
                method.upper(), path, e.code, e.read().decode(errors="replace")
            ) from None
        return json.loads(raw) if raw.strip() else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def create(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str, *, grace_period_seconds: int | None = 0) -> Any:
        body = None
        if grace_period_seconds is not None:
            # No kubelet confirms pod termination here, so graceful deletes would hang.
            body = {
                "kind": "DeleteOptions",
                "apiVersion": "v1",
                "gracePeriodSeconds": grace_period_seconds,
            }
        return self.request("DELETE", path, body)

    def ensure_namespace(self, name: str) -> None:
        try:
            self.create(
                "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}},
            )
        except KubeError as e:
            if e.status != 409:
                raise


def write_kubeconfig(
    path: Path,
    *,
    server_url: str,
    token: str,
    user: str,
    cafile: Path | None = None,
    namespace: str = "default",
) -> Path:
    """Write a single-context, token-authenticated kubeconfig.

    JSON is valid YAML, so kubectl, client-go and the extender all read it.
    """
    cluster: dict[str, Any] = {"server": server_url}
    if cafile is not None:
        cluster["certificate-authority"] = str(cafile.resolve())
    else:
        cluster["insecure-skip-tls-verify"] = True
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "testbed", "cluster": cluster}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {"name": user, "context": {"cluster": "testbed", "user": user, "namespace": namespace}}
        ],
        "current-context": user,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path
