"""The chaos harness's model and invariants: plain functions over observed facts.

Nothing here talks to a supervisor, a VM or the host: :mod:`chaos` observes (a
guest's files and boot id, List's states, /proc, the run root, the log) and feeds
what it saw to these checkers, which compare it with the harness's own model of
what must be true. The unit tests feed them broken facts (a lost write, a leaked
QEMU, a stray run dir, a traceback) and see each one reported.

The model is the harness's, never the product's word: a sandbox's state follows from
the last operation the API acknowledged and the faults the harness injected; where a
fault makes the outcome uncertain (an operation cut by a supervisor kill: it took
effect or it did not) the model holds the set of outcomes allowed, and the next
observation picks one of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass, field

from guestd.codes import CODES

ABSENT = "absent"  # a state the model may allow: the sandbox is not listed
SETTLED = frozenset({"ready", "stopped", "failed", "crashed", "paused"})
# (running: a Run in progress; ready for the model)
TRANSIENT = frozenset({"starting", "stopping", "draining", "running"})
MISSING = ""  # a file content the model may allow: the file is not there
# a file content the model may allow: any at all. A write whose fsync failed (an I/O
# error: the host's disk was full) leaves its file's content unspecified, as POSIX
# says of a failed fsync: its pages, written back with an error, are clean in the
# guest's cache and read again from a disk that may hold part of it, or none
ANY = "*"


@dataclass(frozen=True)
class Violation:
    seed: int
    step: int
    invariant: str
    what: str

    def line(self) -> str:
        return f"seed {self.seed} step {self.step} [{self.invariant}] {self.what}"


@dataclass
class SandboxModel:
    """What must be true of one sandbox, by the harness's account."""

    id: str
    allowed: set[str]  # states it may be in ({"ready"}; {"ready", "paused"} after a cut pause)
    files: dict[str, set[str]] = field(default_factory=dict)  # guest path -> allowed sha256 (MISSING: absent)
    boot: str = ""  # the guest's boot id it must have; "" unknown (the next look learns it)
    not_boot: str = ""  # a boot id it must not have (it rebooted since)
    volume: str = ""  # the volume it mounts read-write at /data ("" none)
    net: bool = False  # user networking, guest port 8000 exposed
    server: bool = False  # an HTTP server was started in this boot
    # paths whose last write was not acknowledged (its fsync failed, or a fault cut it):
    # the running guest may show the new content from its page cache while its disk
    # has the old one, so a look settles nothing about them until the guest boots again
    unsynced: set[str] = field(default_factory=set)

    def rebooted(self) -> None:
        """Its memory is gone (a stop, a killed QEMU, a panic): a new boot id next time,
        and what the next look sees was read from its disk."""
        self.not_boot = self.boot or self.not_boot
        self.boot = ""
        self.server = False
        self.unsynced.clear()


@dataclass
class SnapshotModel:
    name: str
    files: dict[str, set[str]]
    boot: str  # the boot id a restore resumes ("" : a disk-only snapshot, restores boot afresh)
    origin_boot: str = ""  # the origin's boot id then (a disk-only snapshot's restore must not have it)
    net: bool = False
    unsynced: set[str] = field(default_factory=set)  # (the origin's, when its memory is saved)


def state_of(observed: str) -> str:
    return "ready" if observed == "running" else observed


def check_states(model: Mapping[str, SandboxModel], observed: Mapping[str, str]) -> list[tuple[str, str]]:
    """(invariant, what) for every sandbox whose listed state the model does not allow,
    and every listed sandbox the model does not know. Collapses each model's allowed
    set to what was seen (when it was allowed)."""
    out: list[tuple[str, str]] = []
    for id, m in model.items():
        seen = state_of(observed.get(id, ABSENT))
        if seen not in m.allowed:
            out.append(("state", f"{id} is {seen}, the model allows {sorted(m.allowed)}"))
        else:
            m.allowed = {seen}
    for id in sorted(set(observed) - set(model)):
        out.append(("state", f"{id} is listed ({observed[id]}), the model has no such sandbox"))
    return out


def check_files(
    id: str, expected: dict[str, set[str]], observed: Mapping[str, str], unsynced: Set[str] = frozenset()
) -> list[tuple[str, str]]:
    """Every acknowledged, fsynced write is there byte for byte (sha256). ``expected``
    maps a path to the contents allowed (one after an acknowledged write; old and new
    after a write a fault cut, or whose fsync failed); collapsed to what was seen --
    but for the ``unsynced`` paths: what the running guest shows of them may be its
    page cache, not its disk (a write whose fsync failed is gone after a crash, rightly)."""
    out: list[tuple[str, str]] = []
    for path, allowed in sorted(expected.items()):
        got = observed.get(path, MISSING)
        if ANY in allowed:
            continue  # (until the next acknowledged write of it)
        if got not in allowed:
            want = " or ".join(sorted(h[:12] or "missing" for h in allowed))
            out.append(("durability", f"{id}:{path} is {got[:12] or 'missing'}, acknowledged {want}"))
        elif path not in unsynced:
            expected[path] = {got}
    for path in sorted(set(observed) - set(expected)):
        out.append(("durability", f"{id}:{path} exists ({observed[path][:12]}), no write of it was made"))
    return out


def check_boot(m: SandboxModel, boot: str) -> list[tuple[str, str]]:
    """Memory kept (pause/resume, adoption, a restore of a memory snapshot: the same
    boot id) or lost (a new boot id), as the model says."""
    out: list[tuple[str, str]] = []
    if m.boot and boot != m.boot:
        out.append(("state", f"{m.id} booted again (boot id {boot[:8]}, expected {m.boot[:8]}): its memory was lost"))
    if m.not_boot and boot == m.not_boot:
        out.append(("state", f"{m.id} kept boot id {boot[:8]} although its machine ended"))
    m.boot, m.not_boot = boot, ""
    return out


@dataclass(frozen=True)
class HostFacts:
    """What belongs to one serve on the host, as /proc and its dirs show it."""

    qemus: Mapping[int, str]  # pid -> its command line (joined)
    others: Mapping[int, str]  # pid -> what, every other process of its cgroups or naming its dirs
    run_entries: frozenset[str]  # names under the run root
    ram_files: frozenset[str]  # names under its RAM dir
    cgroups: frozenset[str]  # its sandbox cgroups
    mounts: frozenset[str]  # mount points under its work dir (the state dir's own filesystem excluded)
    netns: frozenset[str]  # its jail network namespaces
    stray_files: frozenset[str]  # half-done files at rest: *.part, disk.next.qcow2, ...


HELPER_NAMES = ("qemu-img",)  # short-lived tools a settled serve may still run (a merge, a conversion)


def check_orphans(
    facts: HostFacts, running: int, with_net: int, helpers_allowed: bool = False
) -> list[tuple[str, str]]:
    """Nothing is left behind: a QEMU per running sandbox of the model (ready), no
    other process (a helper, a cell) at rest, every run dir, RAM file and cgroup
    belongs to a live QEMU, no mounts, a jail namespace per networked machine at most,
    no half-done files."""
    out: list[tuple[str, str]] = []
    if len(facts.qemus) > running:
        out.append(
            ("orphans", f"{len(facts.qemus)} QEMU processes, {running} running sandboxes: {sorted(facts.qemus)}")
        )
    if len(facts.qemus) < running:
        out.append(("state", f"{len(facts.qemus)} QEMU processes for {running} running sandboxes"))
    for pid, what in sorted(facts.others.items()):
        if not (helpers_allowed and any(h in what for h in HELPER_NAMES)):
            out.append(("orphans", f"process {pid} ({what})"))
    named = " ".join(facts.qemus.values())
    for entry in sorted(facts.run_entries):
        if entry not in named:
            out.append(("orphans", f"run dir {entry} of no live QEMU"))
    for name in sorted(facts.ram_files):
        if name.split(".", 1)[0] not in named:
            out.append(("orphans", f"RAM file {name} of no live QEMU"))
    if len(facts.cgroups) > running:
        out.append(
            ("orphans", f"{len(facts.cgroups)} cgroups for {running} running sandboxes: {sorted(facts.cgroups)}")
        )
    for m in sorted(facts.mounts):
        out.append(("orphans", f"mount {m}"))
    if len(facts.netns) > with_net:
        out.append(("orphans", f"{len(facts.netns)} network namespaces for {with_net} networked machines"))
    for f in sorted(facts.stray_files):
        out.append(("orphans", f"half-done file {f}"))
    return out


@dataclass(frozen=True)
class Bounds:
    """The supervisor's footprint allowed for ``n`` live sandboxes (measured: an idle
    serve holds ~30 fds and ~90 MiB; each sandbox a handful of fds)."""

    fds_base: int = 96
    fds_per_sandbox: int = 24
    rss_base_mib: int = 400
    rss_per_sandbox_mib: int = 16


def check_bounded(fds: int, rss_mib: int, live: int, bounds: Bounds = Bounds()) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if fds > (limit := bounds.fds_base + bounds.fds_per_sandbox * live):
        out.append(("footprint", f"the supervisor holds {fds} fds (bound {limit} for {live} sandboxes)"))
    if rss_mib > (limit := bounds.rss_base_mib + bounds.rss_per_sandbox_mib * live):
        out.append(("footprint", f"the supervisor's RSS is {rss_mib} MiB (bound {limit} for {live} sandboxes)"))
    return out


def check_error(op: str, exc: BaseException) -> list[tuple[str, str]]:
    """An error a client sees carries one of sandbox.v1's codes."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code in CODES:
        return []
    return [("error-code", f"{op}: {type(exc).__name__} without a code: {exc!s:.200}")]


EXCUSED = frozenset({"RESOURCE_EXHAUSTED"})  # a limit the harness's mix may reach (disk, memory, layers)


def check_refusal(what: str, exc: BaseException) -> list[tuple[str, str]]:
    """An operation the model says must work (its target in a state that allows it, no
    fault in play) refused: the model and the product disagree."""
    code = getattr(exc, "code", "")
    if code in EXCUSED:
        return []
    return [("refused", f"{what}: {exc!s:.300}")]


TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")


def check_log(lines: Iterable[str]) -> list[tuple[str, str]]:
    """No traceback in serve's log: each one reported by the line that ends it (the
    exception), or its last line if the log ends inside it."""
    out: list[tuple[str, str]] = []
    block: list[str] | None = None
    for line in lines:
        if TRACEBACK.match(line):
            if block is not None:
                continue  # a chained traceback: one report, for the last exception
            block = [line]
            continue
        if block is None or not line.strip():
            continue
        block.append(line.strip())
        if not line[0].isspace() and not line.startswith(CHAINED):
            out.append(("traceback", line.strip()[:300]))
            block = None
    if block is not None:
        out.append(("traceback", block[-1][:300]))
    return out


CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


@dataclass(frozen=True)
class SavedStates:
    """Saved machine memory in a serve's state dir, and the snapshot records."""

    memory: list[str]  # snapshot directories holding a memory file or a stream
    recorded: frozenset[str]  # the directories the store's snapshot records name
    forks: int  # records of forks' hidden snapshots
    paused: int  # records of paused sandboxes' saved states


def check_saved_states(saved: SavedStates, live_forks: int, may_be_paused: int) -> list[tuple[str, str]]:
    """Saved memory no record names; a fork's hidden snapshot that outlived every child
    the harness knows may live (``live_forks``: forks with such a child); a paused
    state kept for no sandbox that may be paused."""
    out = [
        ("orphans", f"saved memory in {d}, which no snapshot record names")
        for d in saved.memory
        if d not in saved.recorded
    ]
    if saved.forks > live_forks:
        out.append(("orphans", f"{saved.forks} hidden fork snapshots, {live_forks} forks with a child that may live"))
    if saved.paused > may_be_paused:
        out.append(("orphans", f"{saved.paused} paused saved states, {may_be_paused} sandboxes that may be paused"))
    return out
