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
