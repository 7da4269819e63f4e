"""The rendezvous benchmark's pooling (``--pool``): per-repetition ratios across runs.

The benchmark itself is a measurement and never gates CI; its arithmetic is checked here on
made-up runs, so a claim like "median 0.94x over 23 repetitions" means what it says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "rendezvous.py"


def run(world: int, peer: str, rep: int, t1: float, t2: float, gate: float, status: str = "ok") -> dict:
    return {"world": world, "peer": peer, "rep": rep, "t1_s": t1, "t2_s": t2, "gate_release_s": gate, "status": status}


@pytest.mark.timeout(60)
def test_pool_divides_each_repetition_by_the_same_repetition_of_the_same_run(tmp_path):
    first = {"runs": [run(512, "gridcomm", 0, 0.030, 0.018, 0.008), run(512, "torch", 0, 0.040, 0.020, 0.020),
                      run(512, "gridcomm", 1, 0.050, 0.030, 0.010), run(512, "torch", 1, 0.025, 0.015, 0.005)]}
    # Repetition 0 of the second run must not be paired with repetition 0 of the first; a failed
    # repetition is left out.
    second = {"runs": [run(512, "gridcomm", 0, 0.020, 0.010, 0.005), run(512, "torch", 0, 0.010, 0.020, 0.005),
                       run(512, "gridcomm", 1, 0.020, 0.010, 0.005), run(512, "torch", 1, 0.010, 0.020, 0.005, "failed")]}
    files = []
    for i, report in enumerate((first, second)):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(report))
        files.append(str(path))
    out = subprocess.run([sys.executable, str(BENCH), "--pool", ",".join(files)], capture_output=True, text=True,
                         timeout=50, check=True).stdout
    rows = {tuple(cell.strip() for cell in line.strip("|").split("|"))[:3]: line for line in out.splitlines()
            if line.startswith("| 512")}
    # T2 ratios: 0.018/0.020 = 0.9, 0.030/0.015 = 2.0, 0.010/0.020 = 0.5: median 0.9, two below 1.
    assert "| 3 | 0.90x [0.50..2.00] | 2 |" in rows[("512", "torch", "T2")], out
    # T1: 0.75, 2.0, 2.0; the rest after the gate: 0.022/0.020 = 1.1, 0.040/0.020 = 2.0, 0.015/0.005 = 3.0.
    assert "| 3 | 2.00x [0.75..2.00] | 1 |" in rows[("512", "torch", "T1")], out
    assert "| 3 | 2.00x [1.10..3.00] | 0 |" in rows[("512", "torch", "T1 after its gate")], out


@pytest.mark.timeout(60)
def test_the_written_section_names_no_commit_and_no_temporary_path(tmp_path):
    """What --markdown writes into BENCHMARKS.md: the run's command without its --json file and
    with its revision as REV, no commit hash, and the rest of the file as it was."""
    runs = [dict(run(512, peer, rep, 0.1, 0.05, 0.01), connect_s=1.0, server_cpu_s=0.2, barriers=20, idle_s=5.0)
            for peer in ("gridcomm", "torch") for rep in range(3)]
    report = {"command": "python benchmarks/rendezvous.py --ranks 512 --reps 3 --gridcomm-rev 0badc0de "
                         "--json /tmp/prof/run.json --plot '' --markdown BENCHMARKS.md",
              "date": "2026-12-06 05:00 UTC", "machine": "2 cores", "versions": "grpcio 1.83.2",
              "gridcomm": "b85fcfb", "ranks": [512], "reps": 3, "peers": ["gridcomm", "torch"], "runs": runs}
    raw = tmp_path / "run.json"
    raw.write_text(json.dumps(report))
    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text("# head\n\n<!-- rendezvous:begin (written by benchmarks/rendezvous.py) -->\nold\n"
                   "<!-- rendezvous:end -->\n\n## kept\n")
    subprocess.run([sys.executable, str(BENCH), "--from-json", str(raw), "--plot", "", "--markdown", str(doc)],
                   capture_output=True, text=True, timeout=50, check=True)
    text = doc.read_text()
    assert text.startswith("# head\n\n<!-- rendezvous:begin") and text.endswith("<!-- rendezvous:end -->\n\n## kept\n")
    assert "old\n" not in text and "| 512 | gridcomm |" in text
    for leak in ("b85fcfb", "0badc0de", "/tmp/", "run.json"):
        assert leak not in text, f"{leak!r} in the written section:\n{text}"
    assert "--gridcomm-rev REV --plot '' --markdown BENCHMARKS.md`" in text, text
