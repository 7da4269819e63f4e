"""benchmarks/loadgen.py at a tiny size: 128 simulated ranks in groups of 32, both shapes (relay
addresses known, and the directed join), against a real coordinator process with a 3 s liveness
bound. What is asserted is that the generator speaks the coordinator's protocol as the ranks and
relays do: every rank is joined, the barriers pass, and no rank is failed while the relays'
aggregated heartbeats and the leaders' own run for two bounds after the join (a heartbeat the
coordinator does not take as its rank's, e.g. one naming the wrong process, fails that rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.procs import ROOT


@pytest.mark.timeout(180)
def test_loadgen_joins_every_rank_and_fails_none(tmp_path):
    out = tmp_path / "loadgen.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRIDCOMM_")}
    env["PYTHONPATH"] = ROOT
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "loadgen.py"), "--ranks", "128",
                          "--fanin", "32", "--shapes", "template,no-template", "--heartbeat-timeout-s", "3",
                          "--barriers", "2", "--timeout-s", "60", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=170)
    everything = run.stdout + run.stderr
    rows = json.loads(out.read_text())
    assert sorted(r["shape"] for r in rows) == ["no-template", "template"], everything
    for row in rows:
        assert row["joined"] == 128 and row["status_joined"] == 128, everything
        assert row["failed"] == 0 and row["failures"] == [], everything
        assert row["relays"] == 4 and row["live_s"] == 6.0, everything
        assert row["heartbeat_refused"] == 0, everything
    directed = next(r for r in rows if r["shape"] == "no-template")["asks"]
    assert directed["lead"] == 4 and directed["lead"] + directed["relay"] + directed.get("direct", 0) == 128, everything
    assert run.returncode == 0, everything
