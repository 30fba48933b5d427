"""Where the box's CPU goes: a pytest plugin that, in a run of one test at a time (the slow
tiers), charges each test with the whole machine's busy CPU-seconds from its setup to its
teardown, and says at the end which tests used most and how busy the cores were.

The suite's budget is CPU, not wall time: its Ray clusters, training ranks, Ray Data tasks and
S3 stand-in all share the machine's cores, so a test's wall time alone does not say whether
running two at a time could help (docs/tests.md). The machine-wide count (Linux's /proc/stat) is
what the test's processes and the ones it started used, plus whatever else ran; it is reported,
never asserted on.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

STAT = Path("/proc/stat")
TOP = int(os.environ.get("BOX_CPU_TOP", "15"))  # how many tests the summary lists
# Every test's figures, for planning cuts beyond the summary's top 15 (build/ is git-ignored).
RECORD = Path(__file__).resolve().parents[1] / "build" / "slow-tiers-cpu.json"
MIN_WALL_S = 60.0


def read_busy_s() -> float | None:
    """Busy CPU-seconds of the whole machine since boot: user, nice, system and interrupts (not
    idle, iowait, or steal, the time the hypervisor gave to other guests)."""
    try:
        fields = STAT.read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


class BoxCpu:
    def __init__(self):
        self.items: dict[str, tuple[float, float]] = {}  # nodeid → (busy CPU-s, wall s)
        self.started = (read_busy_s(), time.monotonic())

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        busy, wall = read_busy_s(), time.monotonic()
        yield
        if busy is not None:
            self.items[item.nodeid] = (read_busy_s() - busy, time.monotonic() - wall)

    def pytest_terminal_summary(self, terminalreporter):
        busy0, wall0 = self.started
        if busy0 is None or not self.items:
            return
        busy, wall, cores = read_busy_s() - busy0, time.monotonic() - wall0, os.cpu_count() or 1
        if wall < MIN_WALL_S:  # a few quick tests: nothing to plan a budget by
            return
        write = terminalreporter.write_line
        terminalreporter.section("box CPU by test (whole machine, setup to teardown)")
        for nodeid, (cpu_s, wall_s) in sorted(self.items.items(), key=lambda kv: -kv[1][0])[:TOP]:
            # The kernel counts in ticks (10 ms): a share of a test under a second says nothing.
            share = f"{cpu_s / wall_s / cores:4.0%}" if wall_s >= 1.0 else "    "
            write(f"{cpu_s:8.1f} CPU-s {wall_s:7.1f} s  {share}  {nodeid}")
        write(f"all: {busy:.0f} busy CPU-s in {wall:.0f} s on {cores} cores: {busy / wall / cores:.0%} busy; "
              f"{busy / cores:.0f} s is the least these tests could take on {cores} cores")
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps({"busy_s": round(busy, 1), "wall_s": round(wall, 1), "tests": {
            nodeid: {"cpu_s": round(cpu_s, 1), "wall_s": round(wall_s, 1)}
            for nodeid, (cpu_s, wall_s) in sorted(self.items.items(), key=lambda kv: -kv[1][0])}}, indent=1))
        write(f"every test's figures: {RECORD.relative_to(RECORD.parents[1])}")


def register(config) -> None:
    """Called from tests/conftest.py's pytest_configure."""
    # One test at a time only: with pytest-xdist's workers the machine-wide count of one test
    # would include its neighbours'.
    if getattr(config.option, "numprocesses", None) or hasattr(config, "workerinput"):
        return
    config.pluginmanager.register(BoxCpu(), "box_cpu")


# -- the whole `make test`: its busy CPU-seconds against the suite's budget ----------------------

BUDGET_CPU_S = 2100  # docs/tests.md: `make test`, fast tier and slow tiers together, on the 2-core box


def main(argv: list[str]) -> int:
    """`python tests/box_cpu.py start FILE` before the tiers, `... end FILE` after them: the closing
    lines of `make test` give the whole run's busy CPU-seconds, the floor for this box's cores,
    and one line if the run went over the budget. It warns; it never fails the run."""
    action, path = argv[0], Path(argv[1])
    busy = read_busy_s()
    if busy is None:
        return 0  # no /proc/stat: nothing to say
    if action == "start":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"busy_s": busy, "wall_s": time.time()}))
        return 0
    try:
        start = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    cpu_s, wall_s, cores = busy - start["busy_s"], time.time() - start["wall_s"], os.cpu_count() or 1
    print(f"make test: {cpu_s:.0f} busy CPU-s in {wall_s:.0f} s on {cores} cores ({cpu_s / wall_s / cores:.0%} busy); "
          f"the floor for {cores} cores is {cpu_s / cores:.0f} s; the budget is {BUDGET_CPU_S:,} busy CPU-s")
    if cpu_s > BUDGET_CPU_S:
        print(f"make test: over budget: {cpu_s:,.0f} busy CPU-s > {BUDGET_CPU_S:,} (docs/tests.md says where the "
              f"time goes)")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
