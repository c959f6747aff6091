"""Every benchmark in bench/ runs at its smallest size (issue 50), so that one that breaks breaks
`make test` rather than the next person who follows BENCHMARKS.md.

Each runs as a person runs it (`python bench/X.py ARGS`, a process of its own, with the Kubernetes
binaries, helm and tlsdial that `make test` builds first), and must exit 0 and print its table.
Nothing is timed and no figure is asserted: a benchmark's own checks say whether every pod it
creates is bound or accounted for (throughput.py and dra_scale.py fail a run that leaves pods
unbound, extender.py one whose binds are refused; the others report every pod they create, placed
or pending, in their table).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple[str, ...]
    table: str  # a line of its table (a regular expression, searched for in what it prints)
    label: str = ""  # when a script runs more than once

    @property
    def id(self) -> str:
        return f"{self.script}{'-' + self.label if self.label else ''}"


SMALL_WORKLOADS = ("--seeds", "2", "--pods", "30")
SMALL_CACHE = (
    *("--nodes", "20", "--pods", "40"),
    *("--requests", "20", "--binds", "5", "--demand-changes", "1"),
)
SMOKES = (
    Smoke("allocator.py", ("--seconds", "0", "--decisions", "20", "--states", "100"), r"by demand"),
    Smoke("simulate.py", ("--nodes", "20", "--events", "200"), r"placed \d+, pending at end"),
    Smoke("gangs.py", ("--seeds", "2", "--ultraservers", "1", "--days", "0.2"), r"\| preempt \|"),
    Smoke(
        "gangs.py",
        ("--topology", "--seeds", "2", "--loads", "0.8", "--days", "0.2", "--nodes", "48"),
        r"\| 0.8 \| closest \|",
        "topology",
    ),
    Smoke("preempt_verb.py", ("--units", "2", "--calls", "2"), r"\| 2 \|"),
    Smoke("quality.py", (*SMALL_WORKLOADS, "--out", "{tmp}"), r"first-fit"),
    Smoke(
        "quality.py",
        (*SMALL_WORKLOADS, "--consolidation", "--out", "{tmp}"),
        r"\| inference",
        "consolidation",
    ),
    Smoke("quality_variants.py", SMALL_WORKLOADS, r"the rule in force"),
    Smoke("dra_variants.py", SMALL_WORKLOADS, r"\| order republished, by demand \|"),
    Smoke("autoscaling.py", ("--seeds", "1", "--pods", "30", "--out", "{tmp}"), r"\| both,"),
    Smoke("extender.py", SMALL_CACHE, r"bind, own work under the node lock"),
    Smoke("extender.py", (*SMALL_CACHE, "--tls"), r"HTTPS, client certificate", "tls"),
    Smoke(
        "extender_cpu.py",
        ("--nodes", "20", "--pods", "10", "--window", "10", "--repeats", "1", "--profile", "p"),
        r"^\| all \| [\d.]+ \|\n(.*\n)*.*function calls",
    ),
    Smoke(
        "extender_cpu.py",
        ("--nodes", "20", "--pods", "10", "--window", "10", "--repeats", "1", "--evict-mb", "1"),
        r"caches written over \(1 MB\) before each phase(.*\n)*^\| all \| [\d.]+ \|",
        "evict",
    ),
    Smoke(
        "extender_cpu.py",
        ("--nodes", "20", "--pods", "10", "--window", "10", "--repeats", "1", "--arriving"),
        r"\(10 bound, 0 refused everywhere\)(.*\n)*pods arriving by the watch(.*\n)*^\| all \|",
        "arriving",
    ),
    # With the real kube-apiserver and kube-scheduler (tools/kube), and helm for dra_scale.py.
    Smoke(
        "throughput.py",
        (
            *("--nodes", "5", "--pods", "8", "--stall-seconds", "60"),
            # The configurations' code paths (without-qps, null-h2, null-writes-h2 and
            # null-watch-h2 only change a setting of without and the null extender's others),
            # the policies lifted once, baseline from this checkout.
            "--configs",
            "without,null,null-writes,null-writes-no-policies,null-one-write,ours,ours-h2,baseline",
            *("--baseline-src", str(ROOT / "src")),
            *("--profile", "{tmp}", "--profiler", "cpu"),
        ),
        r"null-writes / null-writes-no-policies = ",
    ),
    Smoke(
        "throughput.py",
        (
            *("--nodes", "5", "--pods", "8", "--stall-seconds", "60"),
            *("--configs", "null-writes,null-watch,null-writes-twin", "--rounds", "2"),
            "--alternate",
        ),
        # (round 2 in the reverse order)
        r"all configurations, round 2\n\n.*\n.*\nnull-writes-twin +8 .*\nnull-watch +8 .*\n"
        r"null-writes +8 (.*\n)*null-watch / null-writes = .*\nnull-writes-twin / null-writes = "
        # (and the sitting's summary over both rounds)
        r"(.*\n)*=== over 2 rounds\nnull-watch / null-writes: [\d.]+ by mean pods/s, [\d.]+ by "
        r"mean CPU a pod; .*extender [+-][\d.]+ \(2 and 2 runs\); by round [\d.]+ / [\d.]+, "
        r"lowest [\d.]+\nnull-writes-twin / null-writes: ",
        "watch-alternate",
    ),
    Smoke(
        "throughput.py",
        ("--nodes", "5", "--pods", "8", "--full-node-list", "--configs", "ours"),
        r"nodeCacheCapable false\n.*\nours +8 ",
        "full-node-list",
    ),
    Smoke(
        "preemption.py", ("--rounds", "1", "--wait", "5", "--pods", "100"), r"first-fit, no verb"
    ),
    Smoke(
        "replay.py", ("--pods", "40", "--per-round", "20", "--sim-seeds", "2"), r"real: \d+ placed"
    ),
    Smoke(
        "requeue.py",
        ("--rounds", "1", "--batch-rounds", "1", "--rings", "2", "--cap", "20"),
        r"^claim +1 ",
    ),
    Smoke(
        "dra_scale.py",
        (
            *("--nodes", "5", "--pods", "4", "--probes", "1", "--probe-seconds", "1"),
            *("--configs", "1,2,4,8,16", "--out", "{tmp}/dra_scale.json"),
        ),
        r"\| 1,2,4,8,16 \| [\d,]+ \|",
    ),
    Smoke("dra_republish.py", ("--rounds", "2"), r"\| trn2\.48xlarge \|"),
    # With helm (the chart's certificates) and tools/tlsdial (kube-scheduler's side).
    Smoke(
        "tls_handshake.py",
        ("--requests", "3", "--rounds", "1"),
        r"^\| ecdsa \| [\d.]+ \|(.*\n)*^\| rsa \| [\d.]+ \|",
    ),
    # With real Kueue (tools/kueue.mk) as well: one node of each type, four workloads.
    Smoke(
        "kueue_admission.py",
        (
            *("--workloads", "4", "--inf2", "1", "--trn1", "1", "--run-seconds", "2", "4"),
            *("--pods-ready-seconds", "10", "--hold-seconds", "6", "--cap", "120"),
        ),
        r"^\| with \| 4 \| \d+ \(\d+\) \|",
    ),
)

# Scripts in bench/ that are not benchmarks of their own, and what runs them here.
HELPERS = {
    "fleet.py": "imported by the others (the checkout on sys.path, the fleet's node types)",
    "nullextender.py": "throughput.py's null configurations",
    "h2serve.py": "throughput.py's ours-h2",
    "cpuprofile.py": "throughput.py --profiler cpu",
    "profile_summary.py": "run on throughput.py's profile (test_profile_summary)",
}


def run(script: str, args: tuple[str, ...], tmp: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(BENCH / script), *(a.replace("{tmp}", str(tmp)) for a in args)]
    return subprocess.run(
        argv, cwd=tmp, capture_output=True, text=True, check=False, env=dict(os.environ)
    )


def test_every_benchmark_runs_here() -> None:
    scripts = {path.name for path in BENCH.glob("*.py")}
    smoked = {smoke.script for smoke in SMOKES}
    assert scripts - set(HELPERS) == smoked, "a benchmark without a smoke run, or a stale entry"
    assert not smoked & set(HELPERS)


@pytest.mark.parametrize("smoke", SMOKES, ids=[s.id for s in SMOKES])
def test_benchmark_runs(smoke: Smoke, tmp_path: Path) -> None:
    result = run(smoke.script, smoke.args, tmp_path)
    shown = f"\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
    assert result.returncode == 0, f"{smoke.id} exited {result.returncode}{shown}"
    assert re.search(smoke.table, result.stdout, re.MULTILINE), f"no table{shown}"
    if smoke.id == "throughput.py":
        # The profile it recorded of our extender, read as BENCHMARKS.md reads one.
        summary = run("profile_summary.py", (str(tmp_path / "ours.txt"), "--pods", "8"), tmp_path)
        assert summary.returncode == 0, summary.stderr
        assert re.search(r"\d+ samples = .* s of CPU", summary.stdout), summary.stdout
