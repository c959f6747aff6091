"""Object names as the API server accepts them (RFC 1123): a name read from an object anyone may
write (a pod's labels and annotations) is checked against these before it goes into a path."""

from __future__ import annotations

import re

SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # pods, Workloads
LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")  # namespaces
