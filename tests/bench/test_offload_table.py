"""bench offload's closing table: every decode key on one line with its figures."""

import random

from freetoken_agent.bench.offload_table import HEADER, decode_table


def test_every_key_gets_its_figures(rng_seed):
    rng = random.Random(rng_seed)
    decode = {}
    for regime in ("native", "uniform"):
        for policy in ("adaptive", "gpu-fill"):
            row = {"tok_s": rng.uniform(50, 900), "limit_tok_s": rng.uniform(900, 2000),
                   "miss_rate": rng.random(), "on_cpu_per_token": rng.uniform(0, 9)}  # fmt: skip
            row["of_limit"] = row["tok_s"] / row["limit_tok_s"]
            row["of_overlap_limit"] = row["of_limit"] * rng.uniform(0.5, 1)
            if policy == "adaptive":
                row["step_path"] = "shared"
                row["path_ms_per_token"] = {"stops": rng.uniform(1, 20), "device": 1.5}
                n, n_trial = rng.randint(50, 250), rng.randint(4, 24)
                trial_share = rng.uniform(0.02, 0.2)
                row["step_ms"] = {
                    "shared": {"n": n, "mean_ms": rng.uniform(2, 9), "time_share": 1 - trial_share},
                    "stops~": {"n": n_trial, "mean_ms": 20.0, "time_share": trial_share},
                }
            elif regime == "native":  # a row without trials
                row["step_ms"] = {"step": {"n": 256, "mean_ms": rng.uniform(1, 9),
                                           "time_share": 1.0}}  # fmt: skip
            decode[f"{regime}|b1|{policy}"] = row
    lines = decode_table(decode)
    assert lines[0] == HEADER and len(lines) == 1 + len(decode)
    for line, (key, row) in zip(lines[1:], decode.items(), strict=True):
        cells = line.split(" | ")
        assert cells[0] == key and float(cells[1]) == round(row["tok_s"], 1)
        assert float(cells[2]) == round(row["limit_tok_s"], 1)
        assert cells[3] == f"{row['of_limit']:.0%}"
        assert cells[4] == f"{row['of_overlap_limit']:.0%}"
        assert float(cells[5]) == round(row["miss_rate"], 3)
        if "step_path" in row:
            stops = row["path_ms_per_token"]["stops"]
            assert cells[7] == f"shared (stops {stops:.2f} device 1.50)"
        else:
            assert cells[7] == "-"
        steps = row.get("step_ms", {})
        steady = [s for label, s in steps.items() if not label.endswith("~")]
        if not steady:
            assert cells[8] == "-"
        else:
            trials = sum(s["time_share"] for label, s in steps.items() if label.endswith("~"))
            assert cells[8] == f"{steady[0]['mean_ms']:.2f} ({trials:.0%})"
