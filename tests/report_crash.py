"""Run by `make test` only when pytest exits non-zero: says why, when pytest itself was killed.

A Ray driver whose local raylet or GCS dies leaves with `_exit(1)`: pytest prints no summary and
the reason is only in the session's log files. This prints what those logs and the machine say,
so a CI log shows the cause instead of a bare "Error 1".
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

SESSION_FILE = Path(__file__).resolve().parents[1] / "build" / "pytest-ray-session"
# Lines worth a reader's time: Ray's errors and fatals, and why a process left.
NOTABLE = re.compile(r"^\[[^\]]+ [EF] |Quick exit|is dead|Shutting down the core worker|Terminating|"
                     r"out of memory|OutOfMemory|No space left|killed", re.IGNORECASE)


def notable_lines(path: Path, limit: int = 25) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:400] for line in lines if NOTABLE.search(line)][-limit:]


def report_session(session: Path) -> None:
    logs = session / "logs"
    print(f"Ray session of the test run: {session}")
    names = ["raylet.out", "raylet.err", "gcs_server.out", "gcs_server.err"]
    paths = [logs / n for n in names] + sorted(logs.glob("python-core-driver-*.log"))
    for path in paths:
        lines = notable_lines(path)
        if lines:
            print(f"--- {path.name} (last {len(lines)} notable lines)")
            print("\n".join(lines))


def report_machine() -> None:
    total, used, free = shutil.disk_usage("/tmp")
    print(f"/tmp: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB")
    try:
        print(Path("/proc/meminfo").read_text().split("\n", 3)[2])  # MemAvailable
    except OSError:
        pass
    kernel = subprocess.run(["dmesg"], capture_output=True, text=True)
    kills = [line for line in kernel.stdout.splitlines() if re.search(r"oom|killed process", line, re.I)]
    if kills:
        print("--- kernel: " + "\n".join(kills[-10:]))


def main() -> int:
    print("=== pytest exited non-zero; what the Ray logs and the machine say ===", flush=True)
    session = SESSION_FILE.read_text().strip() if SESSION_FILE.exists() else ""
    if session and Path(session).is_dir():
        report_session(Path(session))
    else:
        print("no session Ray cluster was started by this test run")
    report_machine()
    return 0


if __name__ == "__main__":
    sys.exit(main())
