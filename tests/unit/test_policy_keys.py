"""The chart's admission policies name the hand-off keys core/handoff.py writes: a key added there
and not to a policy would be refused to the extender, or left open to anyone."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from neuron_scheduler.core import handoff

FILES = Path(__file__).resolve().parents[2] / "charts" / "neuron-scheduler" / "files"
# Whether kubelet has served a pod's containers: written by the device plugin (AWS's too, under
# an account of its own), meaningful only next to ids the hand-off policy keeps.
SERVED = {handoff.ALLOCATED, handoff.ALLOCATED_CONTAINERS}


def variable(path: Path, name: str) -> str:
    spec = yaml.safe_load(path.read_text())
    (expression,) = [v["expression"] for v in spec["variables"] if v["name"] == name]
    return str(expression)


def quoted(expression: str) -> set[str]:
    return set(re.findall(r"'([^']+)'", expression))


def test_the_hand_off_policy_keeps_every_key_that_says_which_devices_a_pod_holds() -> None:
    keys = quoted(variable(FILES / "hand-off-writes.yaml", "keys"))
    assert keys == set(handoff.OURS) - SERVED


def test_the_extender_may_write_every_hand_off_key() -> None:
    allowed = quoted(variable(FILES / "extender-pod-writes.yaml", "foreign"))
    assert set(handoff.OURS) <= allowed, set(handoff.OURS) - allowed
