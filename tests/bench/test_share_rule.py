"""bench share-rule: the replay's rules, its time model and its command line."""

import json
import random

import numpy as np
import torch

from freetoken_agent.bench import share_rule
from freetoken_agent.kernels.reference_fills import SHARE_ONE


def test_a_layers_cost_is_its_slower_branch(rng_seed):
    rng = random.Random(rng_seed)
    costs = share_rule.Costs(rng.uniform(100, 200), rng.uniform(100, 200), rng.uniform(5, 30))
    fills, cpu = rng.randrange(1, 5), rng.randrange(1, 5)
    assert costs.layer_us(fills, 0) == fills * costs.fill_us
    assert costs.layer_us(0, cpu) == costs.handshake_us + cpu * costs.cpu_us
    assert costs.layer_us(fills, cpu) == max(fills * costs.fill_us,
                                             costs.handshake_us + cpu * costs.cpu_us)  # fmt: skip
    assert costs.layer_us(0, 0) == 0


def test_the_rules_split_a_layers_misses_as_the_engine_and_the_old_rule_did(rng_seed):
    rng = random.Random(rng_seed)
    misses = rng.sample(range(64), rng.randrange(2, 9))
    uses = torch.tensor([rng.randrange(4) for _ in range(64)], dtype=torch.int32)
    share = SHARE_ONE // 2
    assert share_rule.layer_cpu("fill-all", misses, share, uses) == []
    coldest = sorted(misses, key=lambda lid: (int(uses[lid]), misses.index(lid)))
    n = (len(misses) * share + SHARE_ONE // 2) >> 16
    assert sorted(share_rule.layer_cpu("rule", misses, share, uses)) == sorted(coldest[:n])
    assert share_rule.layer_cpu("rule", misses[:1], SHARE_ONE, uses) == []  # a lone miss fills
    assert share_rule.layer_cpu("by-order", misses[:1], SHARE_ONE, uses) == misses[:1]
    assert len(share_rule.layer_cpu("by-order", misses, share, uses)) == n


def test_replay_counts_every_miss_once_and_a_zero_share_fills_all(rng_seed):
    """Random routes: at share 0 every rule is fill-all; at a share the CPU's misses and the
    fills add up to the misses, and a cache as large as the lids misses only cold ones."""
    rng = np.random.default_rng(rng_seed)
    steps, layers, pairs, n_lids = 40, 3, 6, 30
    routes = rng.integers(0, n_lids, (steps, layers, pairs))
    costs = share_rule.Costs()
    base = share_rule.replay("fill-all", routes, 12, 0.0, costs, 5)
    for rule in share_rule.RULES:
        assert share_rule.replay(rule, routes, 12, 0.0, costs, 5) == base
        row = share_rule.replay(rule, routes, 12, 0.7, costs, 5)
        assert row["miss_rate"] > 0 and row["step_ms"] > costs.base_ms
        if rule != "fill-all":
            assert row["cpu_per_step"] > 0
    whole = share_rule.replay("fill-all", routes, n_lids, 0.0, costs, 0)
    distinct = len(np.unique(routes))
    experts = sum(len(set(routes[s, layer].tolist())) for s in range(steps)
                  for layer in range(layers))  # fmt: skip
    assert whole["miss_rate"] == distinct / experts


def test_the_command_writes_its_rows(tmp_path, capsys):
    assert share_rule.main(["--layers", "4", "--slots", "100", "--steps", "60", "--warm", "10",
                            "--batch", "2", "--out", str(tmp_path)]) == 0  # fmt: skip
    report = json.loads((tmp_path / "share_rule_4l_b2.json").read_text())
    assert set(report["rows"]) == set(share_rule.RULES)
    assert "modelled" in capsys.readouterr().out
