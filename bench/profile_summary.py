"""Where an extender's CPU went, from a py-spy recording (`bench/throughput.py --profile DIR`).

py-spy samples only threads that are running (not waiting on I/O), so samples / rate is CPU time.
Each sample's stack is put in the first part below that it passes through, then the functions
that took the most time on their own (self) and inside ours (inclusive) are listed. Frames of C
code are not seen: time in uvloop (sockets, TLS) shows as its caller, `Runner.run` at the top.

Run: uv run python bench/profile_summary.py DIR/ours.txt [--pods N] [--rate 200] [--top 12]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# (part, a frame that puts a stack in it), first match wins.
PARTS = (
    ("TLS handshakes, as client (to the API server)", "_create_connection"),
    ("TLS handshakes, as server (kube-scheduler's new connections)", "do_handshake"),
    ("filter handler", "Judge.filter "),
    ("prioritize handler", "Judge.prioritize "),
    ("bind handler (incl. its API calls)", "Binder."),
    ("events sent", "EventRecorder."),
    ("waker", "Waker."),
    ("watch: decode and apply", "Watch."),
    ("verb decode/encode (msgspec)", "Verb._respond "),
    ("verb framing (ASGI, metrics)", "Verb.__call__ "),
    ("HTTP parsing (uvicorn, httptools)", "httptools_impl.py"),
    ("API client (aiohttp)", "aiohttp/"),
    ("garbage collection", "<gc>"),
)
LOOP = "event loop, sockets, TLS (uvloop)"
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


def read(path: Path) -> Counter[str]:
    stacks: Counter[str] = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks[stack] += int(count)
    return stacks


def part(stack: str) -> str:
    for name, marker in PARTS:
        if marker in stack:
            return name
    return LOOP if stack.rsplit(";", 1)[-1].startswith("Runner.run ") else "other"


def function(frame: str) -> str:
    found = FRAME.match(frame)
    return f"{found['function']} ({found['file']})" if found else frame


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("profile", type=Path)
    parser.add_argument("--pods", type=int, default=0, help="pods bound while it was recorded")
    parser.add_argument("--rate", type=int, default=200, help="py-spy's samples per second")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    stacks = read(args.profile)
    samples = sum(stacks.values())
    if not samples:
        raise SystemExit(f"{args.profile}: no samples")
    parts: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inside: Counter[str] = Counter()
    for stack, count in stacks.items():
        parts[part(stack)] += count
        frames = stack.split(";")
        own[function(frames[-1])] += count
        for name in {function(f) for f in frames if "neuron_scheduler/" in f}:
            inside[name] += count

    def line(label: str, count: int) -> str:
        seconds = count / args.rate
        per_pod = f" {1000 * seconds / args.pods:7.3f} ms/pod" if args.pods else ""
        return f"  {100 * count / samples:5.1f}% {seconds:8.2f} s{per_pod}  {label}"

    print(f"{args.profile}: {samples} samples = {samples / args.rate:.1f} s of CPU")
    for name, count in parts.most_common():
        print(line(name, count))
    print("self time:")
    for name, count in own.most_common(args.top):
        print(line(name, count))
    print("inclusive, in neuron_scheduler:")
    for name, count in inside.most_common(args.top):
        print(line(name, count))


if __name__ == "__main__":
    main()
