"""Shared by the benchmarks: where results go and how they are written. Every result file
records the exact command that produced it and the machine it ran on, next to the numbers."""

from __future__ import annotations

import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def describe_machine() -> dict:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "gpu": gpu, "load_avg_1_5_15": [round(x, 1) for x in os.getloadavg()]}


def save_result(name: str, data: dict, table: str) -> Path:
    """bench/results/<name>.json (numbers) and <name>.md (the table, the command, the machine)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])
    record = {"command": command, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": describe_machine(), **data}
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    machine = record["machine"]
    md = (f"# {name}\n\n{table.strip()}\n\nCommand: `{command}`  \n"
          f"Machine: {machine['cpus']} CPUs, {machine['gpu'] or 'no GPU'}, torch {machine['torch']}, "
          f"{machine['platform']}, load average {machine['load_avg_1_5_15']} at the end  \nWhen: {record['when']}\n")
    (RESULTS / f"{name}.md").write_text(md)
    print(md)
    return RESULTS / f"{name}.md"


def markdown_table(header: list[str], rows: list[list]) -> str:
    from app.report import render_markdown_table

    return render_markdown_table(header, rows)
