"""Text from a request or an API object, made fit for one log line. Pure.

Names, keys, reasons and annotation values come from callers and from objects anyone allowed to
create pods may write: a newline in a NodeName would start a log line of the caller's choosing,
NUL or an escape sequence would corrupt what a terminal or a log shipper shows, and a megabyte
would bury everything else. `loggable` escapes every character that is not printable as Python
writes it in a literal (`\\n`, `\\x00`, `\\u202e`) and cuts the text at a limit, saying how much
was left out. Printable text within the limit comes back as it was; what it returns is printable,
so the log format's own pass over each whole message (commandline.setup_logging, with a limit
far above a call site's) leaves what a call site escaped as it was.
"""

from __future__ import annotations

# A pod key (namespace/name: 63 + 1 + 253) or a node name fits whole.
NAME_LIMIT = 320
# Reasons, errors, annotation values: enough for any message of ours and the value it quotes.
TEXT_LIMIT = 1000
# One whole log message (a filter's summary names up to 30 nodes and 10 reasons).
LINE_LIMIT = 16_000


def loggable(value: object, limit: int = TEXT_LIMIT) -> str:
    """`value` as text for a log line: non-printable characters escaped, at most `limit`
    characters of it kept (escapes count as what they stand for)."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit and text.isprintable():
        return text
    kept = text[:limit]
    if not kept.isprintable():
        kept = "".join(c if c.isprintable() else repr(c)[1:-1] for c in kept)
    if len(text) > limit:
        kept += f"...({len(text) - limit} more characters)"
    return kept
