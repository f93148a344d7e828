"""Out-of-memory kills in the guest, read from the kernel's log (/dev/kmsg).

The kernel's OOM killer (the whole guest's, or a guest cgroup's memory limit) says
what it did in two lines of its log::

    oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,task_memcg=/,task=tail,pid=312,uid=0
    Out of memory: Killed process 312 (tail) total-vm:120000kB, anon-rss:98000kB, file-rss:4kB, shmem-rss:0kB, UID:0 ...

The first is written before the victim is sent SIGKILL, the second just after it.
:func:`summary` and :func:`killed` read them (I/O-free, bounded: the host runs
:func:`killed` over the console's text too); :class:`OomWatch` reads the log
without blocking, a bounded number of records per turn of guestd's loop, and keeps
the last victims' pids so that an exec killed by SIGKILL can tell whether the OOM
killer did it (it drains the log first: the summary line is there before the kill).

Only the kernel's own records count: a record a process wrote to /dev/kmsg carries
a user facility (the kernel forces one), so no process forges a kill here. The
guest as a whole is still untrusted: the host checks what guestd reports.
"""

from __future__ import annotations

import errno
import os
import time

from guestd import proto

KMSG = "/dev/kmsg"
MAX_RECORD = 8192  # one read of /dev/kmsg returns one record, at most this long (CONSOLE_EXT_LOG_MAX)
MAX_PER_TURN = 256  # records read in one wakeup: a flood of kernel lines cannot hold guestd's loop
MAX_VICTIMS = 64  # recent victims' pids kept for the exits that follow their kills
# a victim's exit follows its kill within this (s): an older pid may be another process's now
VICTIM_TTL = 60.0
MAX_COMM = 64  # a process name as the log escapes it (the kernel's is 15 bytes; \xNN each at worst)
MAX_WORD = 32  # the constraint (CONSTRAINT_NONE, CONSTRAINT_MEMCG, ...)
MAX_CGROUP = 256  # a cgroup path (cut to this)
MAX_PID = 1 << 22  # PID_MAX_LIMIT
MAX_KB = 1 << 50  # a size in KiB no guest reaches

KILLED = ": Killed process "
SUMMARY = "oom-kill:constraint="


def kernel_text(record: bytes) -> str | None:
    """The message of one /dev/kmsg record (``PRI,SEQ,TIME,FLAGS;TEXT\\n`` and its
    dictionary lines), or None when it is not the kernel's (a user facility) or malformed."""
    head, sep, rest = record[:MAX_RECORD].partition(b";")
    if not sep:
        return None
    pri = head.split(b",", 1)[0]
    if not pri.isdigit() or len(pri) > 10 or int(pri) >> 3 != 0:  # facility 0: the kernel's
        return None
    return rest.split(b"\n", 1)[0].decode("ascii", "replace")  # (the log escapes the rest as \xNN)


def _number(text: str, limit: int) -> int | None:
    return int(text) if text.isdigit() and len(text) <= 20 and int(text) <= limit else None


def summary(text: str) -> tuple[int, str, str] | None:
    """The ``oom-kill:`` line's victim pid, constraint and cgroup (the victim's memory
    cgroup, or the one whose limit was hit), or None. Read from the right where a
    value may hold commas (a cgroup's path, a process name)."""
    at = text.find(SUMMARY)
    if at < 0:
        return None
    line = text[at + len(SUMMARY) : at + MAX_RECORD]
    constraint = line.split(",", 1)[0][:MAX_WORD]
    rest, sep, _uid = line.rpartition(",uid=")
    rest, sep2, pid_text = rest.rpartition(",pid=")
    pid = _number(pid_text, MAX_PID)
    if not (sep and sep2) or pid is None or not constraint:
        return None
    cgroup = ""
    for key in (",task_memcg=", ",oom_memcg="):
        start = rest.find(key)
        if start >= 0:
            end = rest.rfind(",task=")
            cgroup = rest[start + len(key) : end if end > start else len(rest)][:MAX_CGROUP]
            break
    return pid, constraint, cgroup


def killed(text: str) -> proto.OomKill | None:
    """The ``...: Killed process PID (COMM) total-vm:...`` line as a report, or None.
    The name is read up to the last ``) total-vm:`` (a name is 15 bytes: it cannot
    hold the sizes that follow that)."""
    at = text.find(KILLED)
    if at < 0 or "out of memory" not in text[:at].lower():
        return None
    line = text[at + len(KILLED) : at + MAX_RECORD]
    pid_text, sep, rest = line.partition(" (")
    pid = _number(pid_text, MAX_PID)
    end = rest.rfind(") total-vm:")
    if not sep or pid is None or end < 0 or end > MAX_COMM:
        return None
    comm, sizes = rest[:end], rest[end + 2 :]
    values = []
    for key in ("total-vm:", "anon-rss:", "file-rss:", "shmem-rss:"):
        start = sizes.find(key)
        value = _number(sizes[start + len(key) :].split("kB", 1)[0], MAX_KB) if start >= 0 else None
        if value is None:
            return None
        values.append(value)
    total_vm, anon, file, shmem = values
    return proto.OomKill(
        pid=pid, comm=comm, total_vm_kb=total_vm, anon_rss_kb=anon, file_rss_kb=file, shmem_rss_kb=shmem
    )


class OomWatch:
    """The kernel log from now on (opened at its end), read without blocking."""

    def __init__(self, path: str = KMSG) -> None:
        self.fd = -1
        if path:  # ("": records come by feed alone)
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.lseek(self.fd, 0, os.SEEK_END)
        self.victims: dict[int, float] = {}  # the last MAX_VICTIMS pids the OOM killer chose: when
        self.pending: dict[int, tuple[str, str]] = {}  # pid -> (constraint, cgroup) of its summary line
        self.count = 0  # kills reported since guestd started watching

    def drain(self) -> list[proto.OomKill]:
        """The kills the log holds now (at most MAX_PER_TURN records read: the rest at the next turn)."""
        kills = []
        for _ in range(MAX_PER_TURN):
            try:
                record = os.read(self.fd, MAX_RECORD)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them: read on
                    continue
                raise
            if not record:
                break
            kill = self.feed(record)
            if kill is not None:
                kills.append(kill)
        return kills

    def feed(self, record: bytes) -> proto.OomKill | None:
        """One record of the log: a kill to report, or None (a summary line is kept for
        the kill line that follows it; any other record is not ours)."""
        text = kernel_text(record)
        if text is None:
            return None
        seen = summary(text)
        if seen is not None:
            pid, constraint, cgroup = seen
            self._victim(pid)
            self.pending[pid] = (constraint, cgroup)
            while len(self.pending) > MAX_VICTIMS:
                del self.pending[next(iter(self.pending))]
            return None
        kill = killed(text)
        if kill is None:
            return None
        self._victim(kill.pid)
        self.count += 1
        constraint, cgroup = self.pending.pop(kill.pid, ("", ""))
        return proto.OomKill(
            pid=kill.pid,
            comm=kill.comm,
            constraint=constraint,
            cgroup=cgroup,
            total_vm_kb=kill.total_vm_kb,
            anon_rss_kb=kill.anon_rss_kb,
            file_rss_kb=kill.file_rss_kb,
            shmem_rss_kb=kill.shmem_rss_kb,
            seq=self.count,
        )

    def _victim(self, pid: int) -> None:
        self.victims.pop(pid, None)
        self.victims[pid] = time.monotonic()
        while len(self.victims) > MAX_VICTIMS:
            del self.victims[next(iter(self.victims))]

    def was_victim(self, pid: int) -> bool:
        """``pid``, whose process just ended, was a victim of late (once: a pid is reused)."""
        seen = self.victims.pop(pid, None)
        return seen is not None and time.monotonic() - seen <= VICTIM_TTL

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
