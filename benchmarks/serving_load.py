"""Load discipline of the serving benchmark: how busy the machine was during a pass, and
whether the pass counts.

The kernel's 1-minute load average counts every runnable (R) and uninterruptible (D) task,
ours included: at a high request rate P's and D's engines, the router and the client alone keep
two cores' worth of tasks runnable. So by default (``--load-rule foreign``) the benchmark counts
only the load *foreign* to it: a sampler thread reads the number of runnable + blocked tasks
(``procs_running`` + ``procs_blocked`` of /proc/stat) and the number of its own tasks in state R
or D (every thread of this process and of the servers' process groups, from
/proc/PID/task/TID/stat), and keeps the difference as an exponentially damped 1-minute average,
the kernel's own formula (decay exp(-dt/60)), seeded with the kernel's load average when the
sampler starts (before any server of ours runs). ``--load-rule raw`` judges by the kernel's
1-minute load average as it is.

A pass is discarded when its load -- the mean of the chosen 1-minute figure over the samples
taken while its points ran -- exceeds the number of cores. Every figure is kept in the JSON.
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

RULES = ("foreign", "raw")


def parse_proc_stat(text: str) -> int:
    """Runnable + blocked tasks from /proc/stat's ``procs_running`` and ``procs_blocked``."""
    n = 0
    for line in text.splitlines():
        if line.startswith(("procs_running ", "procs_blocked ")):
            n += int(line.split()[1])
    return n


def parse_task_stat(text: str) -> tuple[str, int]:
    """(state, process group) of a /proc/.../stat line (the name may hold spaces and ')')."""
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[2])


def ema(prev: float, value: float, dt: float, tau: float = 60.0) -> float:
    """One step of the kernel's load-average damping over ``dt`` seconds."""
    a = math.exp(-dt / tau)
    return prev * a + value * (1.0 - a)


def pass_load(samples: list[dict], t0: float, t1: float, rule: str) -> float | None:
    """The mean of the rule's 1-minute figure (``foreign_1m`` or ``raw_1m``) over the samples
    taken in [t0, t1] (the nearest sample when none falls inside)."""
    if rule not in RULES:
        raise ValueError(f"load rule {rule!r}: one of {RULES}")
    key = "foreign_1m" if rule == "foreign" else "raw_1m"
    inside = [s[key] for s in samples if t0 <= s["t"] <= t1 and s.get(key) is not None]
    if inside:
        return sum(inside) / len(inside)
    near = [s for s in samples if s.get(key) is not None]
    if not near:
        return None
    return min(near, key=lambda s: min(abs(s["t"] - t0), abs(s["t"] - t1)))[key]


def judge(load: float | None, cores: int) -> tuple[bool, str]:
    """(discard?, why) for a pass whose load is ``load`` on ``cores`` cores. An unknown load
    (no sample) keeps the pass and says so."""
    if load is None:
        return False, "load unknown (no sample): kept"
    if load > cores:
        return True, f"load {load:.2f} > {cores} cores"
    return False, f"load {load:.2f} <= {cores} cores"


def raw_loadavg() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class LoadMonitor:
    """Samples every ``interval`` s: the kernel's load average, all runnable tasks, ours, and
    the foreign 1-minute average. ``own_groups`` are the process groups of our servers (each
    server leads its own session); this process's threads count as ours too."""

    def __init__(self, interval: float = 1.0, proc: str = "/proc") -> None:
        self.interval, self.proc = interval, Path(proc)
        self.own_groups: set[int] = set()
        self.samples: list[dict] = []
        self._pids: list[int] = []
        self._pids_at = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._foreign: float | None = None
        self._own_cpu_prev: tuple[float, float] | None = None
        self._tick = os.sysconf("SC_CLK_TCK")

    def add_group(self, pgid: int) -> None:
        with self._lock:
            self.own_groups.add(pgid)
        self._pids_at = 0.0  # rescan

    def remove_group(self, pgid: int) -> None:
        with self._lock:
            self.own_groups.discard(pgid)
        self._pids_at = 0.0

    def _own_pids(self, now: float) -> list[int]:
        if now - self._pids_at < 5.0 and self._pids:
            return self._pids
        me = os.getpid()
        with self._lock:
            groups = set(self.own_groups)
        pids = [me]
        for d in self.proc.glob("[0-9]*"):
            try:
                pid = int(d.name)
                if pid != me and parse_task_stat((d / "stat").read_text())[1] in groups:
                    pids.append(pid)
            except (OSError, ValueError, IndexError):
                continue
        self._pids, self._pids_at = pids, now
        return pids

    def _own_tasks(self, pids: list[int]) -> tuple[int, float]:
        """(our tasks in state R or D, our CPU seconds so far)."""
        running, cpu = 0, 0.0
        for pid in pids:
            try:
                tasks = list((self.proc / str(pid) / "task").iterdir())
            except OSError:
                continue
            for t in tasks:
                try:
                    text = (t / "stat").read_text()
                except OSError:
                    continue
                try:
                    state = parse_task_stat(text)[0]
                    fields = text.rsplit(")", 1)[1].split()
                    cpu += (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime
                except (ValueError, IndexError):
                    continue
                if state in ("R", "D"):
                    running += 1
        return running, cpu

    def sample(self) -> dict:
        now = time.monotonic()
        pids = self._own_pids(now)
        # the scan of our tasks takes a while (hundreds of threads): read the machine's count
        # before and after it and take the mean, so that neither side is skewed in time
        try:
            before = parse_proc_stat((self.proc / "stat").read_text())
        except (OSError, ValueError):
            before = None
        own, own_cpu = self._own_tasks(pids)
        try:
            after = parse_proc_stat((self.proc / "stat").read_text())
        except (OSError, ValueError):
            after = None
        total = None if before is None or after is None else (before + after) / 2
        raw = raw_loadavg()
        foreign_now = None if total is None else max(0, total - own)
        if self._foreign is None:  # seeded before any server of ours runs
            self._foreign = raw if raw is not None else float(foreign_now or 0)
        elif foreign_now is not None:
            dt = now - self.samples[-1]["t"] if self.samples else self.interval
            self._foreign = ema(self._foreign, foreign_now, dt)
        cpu_rate = None
        if self._own_cpu_prev is not None and now > self._own_cpu_prev[0]:
            # CPU of tasks that ended since the last sample is lost: a lower bound
            cpu_rate = max(0.0, (own_cpu - self._own_cpu_prev[1]) / (now - self._own_cpu_prev[0]))
        self._own_cpu_prev = (now, own_cpu)
        s = {"t": now, "raw_1m": raw, "tasks_runnable": total, "own_runnable": own,
             "own_cpu_cores": cpu_rate, "foreign_1m": self._foreign}
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception:  # never let the sampler end the run
                pass

    def start(self) -> "LoadMonitor":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="load-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)

    def window(self, t0: float, t1: float) -> dict:
        """Figures over [t0, t1]: means and maxima of every series, for the JSON (``samples``
        counts those inside; with none, the nearest sample stands in)."""
        inside = [s for s in self.samples if t0 <= s["t"] <= t1]
        out: dict = {"samples": len(inside)}
        if not inside and self.samples:  # a point shorter than the interval: the nearest one
            inside = [min(self.samples, key=lambda s: min(abs(s["t"] - t0), abs(s["t"] - t1)))]
        for key in ("raw_1m", "foreign_1m", "own_runnable", "own_cpu_cores", "tasks_runnable"):
            vals = [s[key] for s in inside if s.get(key) is not None]
            out[f"{key}_mean"] = sum(vals) / len(vals) if vals else None
            out[f"{key}_max"] = max(vals) if vals else None
        return out
