"""Kubernetes objects decoded from JSON whatever their depth.

kube-apiserver accepts objects nested up to 10,000 levels (its JSON decoder's bound, measured:
10,100 refused), in fields nothing here reads: a pod's metadata.managedFields, which whoever may
patch the pod may write, or a claim's opaque config. msgspec descends one level per call even
through a field it skips, and raises RecursionError past CPython's limit (1,000 levels; on 3.12
and later a fixed C limit that `sys.setrecursionlimit` does not move). One pod patched 2,000
deep made every decode of it fail: each page of the pod list, each watch event of it, in the
extender, the device plugin and the views alike, so the extender's pod watch never saw that
pod's deletion.

So a decode that runs out of depth is done again on the text with every value nested deeper
than `KEPT_LEVELS` replaced by null: no field any of our types reads is that deep (a Workload's
pod templates, the deepest, are under 40). The first try is the only cost of the usual case."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

KEPT_LEVELS = 100
# A JSON string (its escapes skipped, unrolled so that a long one is one match), a bracket, or a
# quote that opens no whole string: unterminated, the rest of the text is malformed (without it,
# each later quote would start a scan to the end again: quadratic).
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|"')
_OPENING = frozenset(b"[{")


def decode(text: bytes | str | msgspec.Raw, kind: type[T]) -> T:
    """`text` as `kind` (msgspec.DecodeError when it is not one), however deep it nests."""
    try:
        return msgspec.json.decode(text, type=kind)
    except RecursionError:
        return msgspec.json.decode(shallow(text), type=kind)


def decode_any(text: bytes | str | msgspec.Raw) -> Any:
    """`text` as whatever JSON it holds, however deep it nests."""
    try:
        return msgspec.json.decode(text)
    except RecursionError:
        return msgspec.json.decode(shallow(text))


def shallow(text: bytes | str | msgspec.Raw, levels: int = KEPT_LEVELS) -> bytes:
    """The JSON `text` with each value nested deeper than `levels` replaced by null, in one pass
    that does not recurse (malformed text stays malformed, for the decoder to say so)."""
    raw = text.encode() if isinstance(text, str) else bytes(text)
    kept: list[bytes] = []
    depth = 0
    cut = -1  # where the value being dropped starts
    last = 0  # the text before it is kept
    for token in _TOKENS.finditer(raw):
        first = raw[token.start()]
        if first == 0x22:  # a string: brackets in it are no brackets
            if token.end() - token.start() == 1:
                return raw  # unterminated: malformed, for the decoder to say so
            continue
        if first in _OPENING:
            depth += 1
            if depth == levels + 1:
                cut = token.start()
        else:
            if depth == levels + 1 and cut >= 0:
                kept += (raw[last:cut], b"null")
                last, cut = token.end(), -1
            depth -= 1
    kept.append(raw[last:])
    return b"".join(kept)
