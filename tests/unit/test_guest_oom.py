"""The guest's OOM kills without a VM: guestd's reading of the kernel log (guestd/oom.py:
the kernel's lines, a user's forged ones, hostile process names and cgroup paths,
mutated and random records), the host's checks of a report, its events' rate, and the
cause of a death an OOM kill led to (actors/sandboxes/oomkills.py).
(The real kills on a real guest: tests/vm/test_lifetime.py.)"""

from __future__ import annotations

import random

import pytest
import trio
from trio.testing import MockClock

from actors.channel.guest import GuestProtocolError, open_channel
from actors.channel.guestwire import check_ranges
from actors.model import Action, Ending
from actors.sandboxes.oomkills import OOM_EVENT_BURST, OOM_EVENT_INTERVAL, GuestOoms, oom_death, printable
from guestd import oom, proto
from tests.support.fakeguest import fake_guest

SUMMARY = (
    "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
    "task_memcg=/,task=tail,pid=312,uid=0"
)
MEMCG = (
    "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/box,"
    "task_memcg=/box/a,b,task=py,pid=77,uid=1000"
)
KILLED = (
    "Out of memory: Killed process 312 (tail) total-vm:120520kB, anon-rss:98304kB, file-rss:4kB, "
    "shmem-rss:0kB, UID:0 pgtables:300kB oom_score_adj:0"
)


def record(text: str, pri: int = 3, seq: int = 100) -> bytes:
    """A /dev/kmsg record: the kernel's (facility 0) unless ``pri`` says otherwise."""
    return f"{pri},{seq},123456789,-;{text}\n SUBSYSTEM=x\n".encode()


def test_the_kernel_s_lines_are_one_report() -> None:
    watch = oom.OomWatch(path="")
    assert watch.feed(record(SUMMARY, pri=6)) is None  # (kept for the kill line)
    assert 312 in watch.victims  # before the kill line: an exit reaped now is the OOM killer's
    kill = watch.feed(record(KILLED))
    assert kill == proto.OomKill(
        pid=312,
        comm="tail",
        constraint="CONSTRAINT_NONE",
        cgroup="/",
        total_vm_kb=120520,
        anon_rss_kb=98304,
        file_rss_kb=4,
        shmem_rss_kb=0,
        seq=1,
    )
    assert watch.was_victim(312) and not watch.was_victim(313)
    assert not watch.was_victim(312)  # once: the pid may be another process's next


def test_an_old_victim_s_pid_is_not_taken_for_a_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = oom.OomWatch(path="")
    now = [1000.0]
    monkeypatch.setattr(oom.time, "monotonic", lambda: now[0])
    watch.feed(record(KILLED))
    now[0] += oom.VICTIM_TTL + 1
    assert not watch.was_victim(312)


def test_a_cgroup_s_kill_names_its_cgroup_and_the_other_messages() -> None:
    assert oom.summary(MEMCG) == (77, "CONSTRAINT_MEMCG", "/box/a,b")
    line = "Memory cgroup out of memory: Killed process 77 (py) total-vm:1kB, anon-rss:2kB, file-rss:3kB, shmem-rss:4kB"
    kill = oom.killed(line)
    assert kill is not None and (kill.pid, kill.comm, kill.shmem_rss_kb) == (77, "py", 4)
    allocating = "Out of memory (oom_kill_allocating_task): " + KILLED.split(": ", 1)[1]
    assert oom.killed(allocating) is not None
    # the console's copy (a timestamp first) reads the same
    assert oom.killed("[   12.345678] " + KILLED) == oom.killed(KILLED)


def test_a_line_a_process_wrote_is_not_the_kernel_s() -> None:
    watch = oom.OomWatch(path="")
    for pri in (8 + 3, 14, 1 << 3):  # user facility (the kernel forces one on a write to /dev/kmsg)
        assert watch.feed(record(SUMMARY, pri=pri)) is None
        assert watch.feed(record(KILLED, pri=pri)) is None
    assert not watch.was_victim(312) and watch.count == 0
    for bad in (b"", b"no header", b"x,1,2,-;" + KILLED.encode(), b"99999999999,1;" + KILLED.encode()):
        assert oom.kernel_text(bad) is None


def test_hostile_names_and_paths_do_not_move_the_kernel_s_numbers() -> None:
    # a name (15 bytes) made to look like the fields after it
    kill = oom.killed(KILLED.replace("(tail)", "(a) total-vm:1kB)"))
    assert kill is not None and (kill.pid, kill.comm, kill.total_vm_kb) == (312, "a) total-vm:1kB", 120520)
    kill = oom.killed(KILLED.replace("(tail)", "((x) (y))"))
    assert kill is not None and kill.comm == "(x) (y)"
    # a summary whose name holds ",pid=1,uid=0": the pid is the last one, the kernel's
    seen = oom.summary(SUMMARY.replace("task=tail", "task=x,pid=1,uid=0"))
    assert seen is not None and seen[0] == 312
    # a cgroup path holding ",task=": cut, bounded
    seen = oom.summary(SUMMARY.replace("task_memcg=/", "task_memcg=/" + "a" * 5000 + ",task=z"))
    assert seen is not None and seen[0] == 312 and len(seen[2]) <= oom.MAX_CGROUP


@pytest.mark.parametrize(
    "line",
    [
        KILLED.replace("312", "99999999999"),  # beyond PID_MAX_LIMIT
        KILLED.replace("312", "-1"),
        KILLED.replace("anon-rss:98304kB", "anon-rss:lots"),
        KILLED.replace("total-vm:120520kB, ", ""),
        KILLED.replace("Out of memory", "Out of luck"),
        KILLED.replace("(tail)", "(" + "n" * 100 + ")"),  # a name longer than the log could escape
        KILLED.replace("120520", "9" * 30),
        KILLED[:60],
        "Out of memory: Killed process ",
    ],
)
def test_a_malformed_kill_line_is_none(line: str) -> None:
    assert oom.killed(line) is None


@pytest.mark.parametrize(
    "line", [SUMMARY.replace("pid=312", "pid=x"), SUMMARY.replace(",uid=0", ""), "oom-kill:constraint=", "oom-kill:"]
)
def test_a_malformed_summary_is_none(line: str) -> None:
    assert oom.summary(line) is None


def test_mutated_and_random_records_never_raise_and_stay_bounded() -> None:
    rng = random.Random(35)
    watch = oom.OomWatch(path="")
    seeds = [record(SUMMARY, pri=6), record(KILLED), record(MEMCG)]
    for i in range(3000):
        base = bytearray(rng.choice(seeds))
        for _ in range(rng.randrange(1, 8)):
            op = rng.randrange(3)
            at = rng.randrange(len(base) + 1)
            if op == 0 and base:
                del base[at : at + rng.randrange(1, 20)]
            elif op == 1:
                base[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
            else:
                base[at:at] = rng.choice([b",pid=", b") total-vm:", b"kB", b";", b"\n", b"(", b"9" * 25])
        data = bytes(base) if i % 10 else bytes(rng.randrange(256) for _ in range(rng.randrange(0, 9000)))
        kill = watch.feed(data)
        if kill is not None:
            check_ranges(kill)  # what guestd reports, the host takes
            assert 1 <= kill.pid <= oom.MAX_PID and len(kill.comm) <= oom.MAX_COMM
    assert len(watch.victims) <= oom.MAX_VICTIMS and len(watch.pending) <= oom.MAX_VICTIMS


def test_the_host_refuses_a_report_out_of_its_bounds() -> None:
    good = proto.OomKill(pid=5, comm="x", constraint="CONSTRAINT_NONE", cgroup="/")
    check_ranges(good)
    for bad in (
        proto.OomKill(pid=0, comm="x"),
        proto.OomKill(pid=1 << 23, comm="x"),
        proto.OomKill(pid=5, comm="x" * 65),
        proto.OomKill(pid=5, comm="x", cgroup="/" * 257),
        proto.OomKill(pid=5, comm="x", constraint="C" * 33),
        proto.OomKill(pid=5, comm="x", anon_rss_kb=-1),
    ):
        with pytest.raises(proto.BadMessage):
            check_ranges(bad)
    # and on the wire: decoded by type, checked by range
    assert proto.decode(proto.encode(good)[4:]) == good


def test_reports_become_events_at_a_bounded_rate() -> None:
    now = [0.0]
    events: list[tuple[Action, dict[str, str]]] = []
    ooms = GuestOoms(lambda action, **kw: events.append((action, kw)), clock=lambda: now[0])
    kill = proto.OomKill(pid=9, comm="hog\x1b[2J", constraint="CONSTRAINT_NONE", cgroup="/", anon_rss_kb=7)
    for _ in range(OOM_EVENT_BURST + 5):
        ooms.report(kill)
    assert len(events) == OOM_EVENT_BURST and ooms.count == OOM_EVENT_BURST + 5
    action, first = events[0]
    assert action == Action.OOM_KILL
    assert first == {
        "by": "guest",
        "pid": "9",
        "process": "hog?[2J",  # no control character reaches a terminal or a log
        "constraint": "CONSTRAINT_NONE",
        "cgroup": "/",
        "anon_rss_kb": "7",
        "total_vm_kb": "0",
        "count": "1",
    }
    now[0] += OOM_EVENT_INTERVAL
    ooms.report(kill)
    assert events[-1][1]["suppressed"] == "5" and events[-1][1]["count"] == str(OOM_EVENT_BURST + 6)
    assert len(ooms.recent) <= 8 and printable("a\nb") == "a?b"


CONSOLE = f"[    3.1] random: crng init done\n[   40.2] {KILLED}\n"


def test_an_init_that_died_of_an_oom_kill_is_out_of_memory_by_the_guest() -> None:
    panic = "Kernel panic - not syncing: Attempted to kill init! exitcode=0x00008900"  # status 137
    cause = oom_death(panic, CONSOLE, [])
    assert cause is not None and (cause.ending, cause.by) == (Ending.OUT_OF_MEMORY, "guest")
    assert "tail (pid 312)" in cause.detail and "status 137" in cause.detail
    assert cause.crashed and cause.sentence().startswith("out of memory: the guest's OOM killer")
    # killed by SIGKILL itself, and the kill known from guestd's report alone
    report = proto.OomKill(pid=4, comm="app")
    cause = oom_death(panic.replace("00008900", "00000009"), "", [report])
    assert cause is not None and "app (pid 4)" in cause.detail


@pytest.mark.parametrize(
    ("panic", "console"),
    [
        ("Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000100", CONSOLE),  # exit 1
        ("Kernel panic - not syncing: Attempted to kill init! exitcode=0x00008900", "no kill here\n"),
        ("Kernel panic - not syncing: Attempted to kill init! exitcode=zzz", CONSOLE),
        ("Kernel panic - not syncing: Out of memory: system-wide panic_on_oom is enabled", CONSOLE),
        ("Kernel panic - not syncing: sysrq triggered crash", CONSOLE),
    ],
)
def test_other_panics_stay_panics(panic: str, console: str) -> None:
    assert oom_death(panic, console, []) is None


async def test_the_channel_hands_reports_to_its_listener_and_breaks_on_one_beyond_bounds(
    autojump_clock: MockClock,
) -> None:
    good = proto.OomKill(pid=7, comm="hog", constraint="CONSTRAINT_NONE", cgroup="/", anon_rss_kb=5)
    with trio.fail_after(5):
        async with fake_guest() as guest:
            guest.hostile.garbage_after_hello = proto.encode(good) * 2  # unsolicited, right after the hello
            got: list[proto.OomKill] = []
            async with open_channel(guest.connect(), hello_timeout=None) as chan:
                chan.on_oom_kill = got.append
                await chan.hello(5)
                await chan.ping()  # (answered after them: they were read)
                assert got == [good, good]
            guest.hostile.garbage_after_hello = proto.encode(proto.OomKill(pid=7, comm="x" * 100))
            async with open_channel(guest.connect(), hello_timeout=None) as chan:
                chan.on_oom_kill = got.append
                await chan.hello(5)
                with pytest.raises(GuestProtocolError, match="longer than 64"):
                    await chan.ping()
                assert chan.broken and len(got) == 2
