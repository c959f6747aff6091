"""Issue 35: text from a request or an API object cannot forge a log line. Call sites escape and
bound what they quote (core.logtext), so a record's message is one printable line under any
handler; the processes' own format (commandline.OneLineFormatter) does the same for every
message and indents tracebacks, so only a record starts a line."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Iterator

import pytest

from neuron_scheduler.commandline import LOG_FORMAT, OneLineFormatter
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.logtext import LINE_LIMIT, TEXT_LIMIT, loggable
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.verbs.wire import BadRequest, ExtenderArgs, ExtenderBindingArgs
from neuron_scheduler.extender.wiring import wire
from tests.builders import node, pod
from tests.podapi import FakeAPI

FORGED = "2026-11-25 12:00:00,000 WARNING neuron_scheduler.extender: forged"
HOSTILE_NAMES = [
    f"n1\n{FORGED}",
    f"n1\r\n{FORGED}",
    f"nul\x00{FORGED}",
    f"esc\x1b[2J\u2028{FORGED}",
    "long" + "x" * 100_000,
]
# What starts every line the format writes: a record's time, level and logger.
RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ neuron_scheduler[.\w]*: ")


class Written:
    """What the processes' log format writes for neuron_scheduler's records, and the records."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.records: list[logging.LogRecord] = []

    @property
    def lines(self) -> list[str]:
        return self.stream.getvalue().split("\n")[:-1]


@pytest.fixture
def written() -> Iterator[Written]:
    out = Written()
    handler = logging.StreamHandler(out.stream)
    handler.setFormatter(OneLineFormatter(LOG_FORMAT))
    keep = logging.Handler()
    keep.emit = out.records.append  # type: ignore[method-assign]
    logger = logging.getLogger("neuron_scheduler")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.addHandler(keep)
    yield out
    logger.removeHandler(handler)
    logger.removeHandler(keep)
    logger.setLevel(level)


def assert_one_line_each(written: Written) -> None:
    assert written.records, "nothing was logged"
    for record in written.records:  # as any handler gets them: call sites escaped the text
        message = record.getMessage()
        assert message.isprintable(), message[:200]
        assert len(message) < LINE_LIMIT
    assert len(written.lines) == len(written.records)
    for line in written.lines:
        assert RECORD_START.match(line), line[:200]
        assert FORGED not in line or not line.startswith(FORGED)
        assert line.isprintable()


def test_loggable_escapes_and_bounds() -> None:
    assert loggable("plain name-1.example") == "plain name-1.example"
    assert loggable("a\nb\x00c\x1b\u202e") == "a\\nb\\x00c\\x1b\\u202e"
    assert loggable(loggable("a\nb")) == "a\\nb"  # a second pass changes nothing
    long = loggable("y" * 5000)
    assert long == "y" * TEXT_LIMIT + "...(4000 more characters)"
    assert loggable(ValueError("bad\nthing")) == "bad\\nthing"
    assert loggable("z" * 30, limit=10) == "z" * 10 + "...(20 more characters)"


def test_node_names_in_a_filter_request_cannot_forge_a_log_line(written: Written) -> None:
    extender = wire(FakeAPI(), Catalog.builtin())  # type: ignore[arg-type]
    extender.ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    asking = pod(f"asking\n{FORGED}", {NEURON: 1})
    logging.getLogger("neuron_scheduler").setLevel(logging.DEBUG)  # n1 passes: lines at DEBUG
    extender.judge.filter(ExtenderArgs(Pod=asking, NodeNames=["n1", *HOSTILE_NAMES]))
    assert_one_line_each(written)
    messages = [r.getMessage() for r in written.records]
    assert any(m.startswith("Failed nodes for POD") for m in messages), messages
    assert any("n1\\n2026-11-25" in m for m in messages)  # there, escaped


@pytest.mark.parametrize("name", HOSTILE_NAMES)
async def test_a_bind_to_such_a_node_name_is_refused_before_anything_is_logged(
    written: Written, name: str
) -> None:
    api = FakeAPI()
    extender = wire(api, Catalog.builtin())  # type: ignore[arg-type]
    extender.synced.set()
    with pytest.raises(BadRequest) as refused:
        await extender.binder.bind(ExtenderBindingArgs("p", "default", "uid-p", name))
    assert str(refused.value).isprintable()
    assert not written.records


def test_the_format_indents_tracebacks_and_escapes_what_call_sites_did_not(
    written: Written,
) -> None:
    log = logging.getLogger("neuron_scheduler.test")
    log.warning("raw %s", f"x\n{FORGED}")  # a call site that forgot
    try:
        raise ValueError(f"from a request\n{FORGED}")
    except ValueError:
        log.exception("failed")
    lines = written.lines
    assert lines[0] == f"{lines[0][:23]} WARNING neuron_scheduler.test: raw x\\n{FORGED}"
    assert RECORD_START.match(lines[1])
    assert all(line.startswith("    ") for line in lines[2:]), lines
    assert any("Traceback (most recent call last)" in line for line in lines)


def test_a_filter_logs_at_info_only_when_no_node_passed_and_a_line_per_node_at_debug(
    written: Written,
) -> None:
    extender = wire(FakeAPI(), Catalog.builtin())  # type: ignore[arg-type]
    extender.ledger.replace_nodes([node(f"n{i}", "inf1.6xlarge") for i in range(3)])
    asking = pod("asking", {NEURON: 1})
    extender.judge.filter(ExtenderArgs(Pod=asking, NodeNames=["n0", "n1", "n2"]))
    assert not written.records  # nodes passed: the bind says where the pod went
    too_big = pod("too-big", {NEURON: 8})  # an inf1.6xlarge has four devices
    extender.judge.filter(ExtenderArgs(Pod=too_big, NodeNames=["n0", "n1"]))
    messages = [r.getMessage() for r in written.records]
    assert (
        messages[0]
        == "Filtered nodes for POD default/too-big (8 devices (aws.amazon.com/neuron)): []"
    )
    assert messages[1].startswith("Failed nodes for POD default/too-big: map[n0:")
    assert len(messages) == 2 and {r.levelno for r in written.records} == {logging.INFO}
    written.records.clear()
    logging.getLogger("neuron_scheduler").setLevel(logging.DEBUG)  # the fixture restores it
    extender.judge.filter(ExtenderArgs(Pod=asking, NodeNames=["n0", "n1", "n2"]))
    messages = [r.getMessage() for r in written.records]
    assert (
        "Filtered nodes for POD default/asking (1 device (aws.amazon.com/neuron)): [n0 n1 n2]"
        in (messages)
    )
    fits = [m for m in messages if "fits in Node" in m]
    assert fits == [f"POD default/asking fits in Node:n{i}" for i in range(3)]


def test_the_format_writes_each_records_time_as_the_standard_formatter_does() -> None:
    """OneLineFormatter formats the date once a second (issue 50): records within a second, across
    one and back in time still get their own time, to the millisecond."""
    ours, standard = OneLineFormatter(LOG_FORMAT), logging.Formatter(LOG_FORMAT)
    for created in (1_800_000_000.001, 1_800_000_000.999, 1_800_000_001.0, 1_700_000_000.5):
        record = logging.LogRecord("neuron_scheduler", logging.INFO, "", 0, "m", (), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert ours.format(record) == standard.format(record)
