"""/etc/environment with our variables replaced and every other line kept. Pure."""

from __future__ import annotations

import re

DEFAULT_ENVIRONMENT_FILE = "/etc/environment"
VARIABLES = (
    "NEURON_GLOBAL_TOPOID",
    "NEURON_GLOBAL_TOPOID0_HOST",
    "NEURON_RT_ULTRASERVER_MODE",
    "NEURON_RT_ULTRASERVER_SERVER_ID",
    "NEURON_RT_ULTRASERVER_NODE_ID",
)
_ASSIGNMENT = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=")


def update(text: str, values: dict[str, str]) -> str:
    """Drop earlier lines that set one of VARIABLES (or a key of values), keep the rest in order,
    append the new values."""
    replaced = set(VARIABLES) | set(values)
    kept = []
    for line in text.splitlines():
        match = _ASSIGNMENT.match(line)
        if match and match.group(1) in replaced:
            continue
        kept.append(line)
    kept += [f"{name}={value}" for name, value in values.items()]
    return "".join(line + "\n" for line in kept)


def parse(text: str) -> dict[str, str]:
    """KEY=value lines as pam_env reads /etc/environment (quotes stripped)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        match = _ASSIGNMENT.match(line)
        if match:
            value = line[match.end() :].strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            found[match.group(1)] = value
    return found
