"""`freetoken bench worker-teams` runs on the CPU: both teams answer every job, and each row
carries the job time and its bytes beside the host's read bandwidth."""

import json
import random

import pytest

from freetoken_agent.bench import worker_teams
from freetoken_agent.kernels.cpu import worker

pytestmark = pytest.mark.skipif(not worker.available(), reason="no SIMD expert kernel here")


@pytest.mark.parametrize("threads", [1, None])
def test_worker_teams_reports_both_teams(tmp_path, monkeypatch, threads):
    """Each row names the threads its team ran: the option's, else the team's own default, as
    the engine's worker starts it (the report named default_threads() for both, where the spin
    team runs spin_team_size())."""
    from freetoken_agent.kernels.cpu import experts

    n = random.choice([1, 2])
    monkeypatch.delenv(experts.ENV_THREADS, raising=False)
    args = ["--experts", str(n), "--jobs", "4", "--gap-us", "100", "--pool-gb", "0.1"]
    if threads is not None:
        args += ["--threads", str(threads)]
    rc = worker_teams.main([*args, "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "worker_teams.json").read_text())
    assert [r["team"] for r in report["rows"]] == list(worker.TEAMS)
    defaults = {"spin": experts.spin_team_size(), "omp": experts.default_threads()}
    for row in report["rows"]:
        assert row["threads"] == (threads or defaults[row["team"]]), row
        assert row["experts"] == n and row["median_ms"] > 0
        assert row["of_read_limit"] == pytest.approx(row["gb_s"] * 1e9 / (
            report["host_read_gb_s"] * 1e9), rel=1e-6)  # fmt: skip
