"""`freetoken bench worker-teams` runs on the CPU: both teams answer every job, and each row
carries the job time and its bytes beside the host's read bandwidth."""

import json
import random

import pytest

from freetoken_agent.bench import worker_teams
from freetoken_agent.kernels.cpu import worker

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")


def test_worker_teams_reports_both_teams(tmp_path):
    n = random.choice([1, 2])
    args = ["--experts", str(n), "--jobs", "4", "--gap-us", "100", "--pool-gb", "0.1"]
    rc = worker_teams.main([*args, "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "worker_teams.json").read_text())
    assert [r["team"] for r in report["rows"]] == list(worker.TEAMS)
    for row in report["rows"]:
        assert row["experts"] == n and row["median_ms"] > 0
        assert row["of_read_limit"] == pytest.approx(row["gb_s"] * 1e9 / (
            report["host_read_gb_s"] * 1e9), rel=1e-6)  # fmt: skip
