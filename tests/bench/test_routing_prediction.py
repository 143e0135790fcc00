"""bench routing-prediction: its counts, its router and its random decoder's mathematics."""

import json
import math
import random

import torch
import torch.nn.functional as F

from freetoken_agent.bench import routing_prediction as rp

TINY = rp.Shape(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=12, top_k=3,
                expert_width=24, rope_theta=10000.0)  # fmt: skip


def test_predicted_share_counts_the_routed_pairs_named(rng_seed):
    rng = random.Random(rng_seed)
    t, k, e = rng.randrange(2, 9), 4, 16
    routed = torch.tensor([rng.sample(range(e), k) for _ in range(t)])
    predicted = torch.tensor([rng.sample(range(e), k) for _ in range(t)])
    pairs = zip(routed.tolist(), predicted.tolist(), strict=True)
    named = sum(len(set(a) & set(b)) for a, b in pairs)
    assert math.isclose(rp.predicted_share(predicted, routed), named / (t * k))
    assert rp.predicted_share(routed.flip(-1), routed) == 1.0


def test_new_pairs_are_first_routings_after_the_warm_tokens(rng_seed):
    rng = random.Random(rng_seed)
    t, k, e, warm = 20, 3, 10, rng.randrange(0, 5)
    routed = torch.tensor([rng.sample(range(e), k) for _ in range(t)])
    predicted = torch.tensor([rng.sample(range(e), k) for _ in range(t)])
    new = caught = wasted = 0
    for i in range(warm, t):
        before = set(routed[:i].flatten().tolist())
        fresh = set(routed[i].tolist()) - before
        guess = set(predicted[i].tolist())
        new += len(fresh)
        caught += len(fresh & guess)
        wasted += len(guess - before - set(routed[i].tolist()))
    assert rp.new_pairs(routed, predicted, warm) == (new, caught, wasted)
    assert rp.new_pairs(routed, routed, warm) == (new, new, 0)


def test_the_router_takes_the_softmax_top_k_renormalised(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    state, gate = torch.randn(5, 32, generator=gen), torch.randn(7, 32, generator=gen)
    weights, experts = rp.route(state, gate, 3)
    x = state / state.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    probs = (x @ gate.T).softmax(-1)
    assert torch.equal(experts, probs.topk(3, -1).indices)
    top = probs.gather(1, experts)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))


def test_attention_is_causal_gqa_over_rotated_normed_heads(rng_seed):
    """The block against torch's SDPA over the same drawn weights."""
    model = rp.RandomDecoder(TINY, std=0.1, seed=rng_seed)
    twin = rp.RandomDecoder(TINY, std=0.1, seed=rng_seed)
    t, s = 6, TINY
    h = torch.randn(t, s.hidden, generator=torch.Generator().manual_seed(rng_seed + 1))
    pos = torch.arange(t)
    out = model.attention(h, pos)
    wq, wk = twin.draw(s.heads * s.head_dim, s.hidden), twin.draw(s.kv_heads * s.head_dim, s.hidden)
    wv, wo = twin.draw(s.kv_heads * s.head_dim, s.hidden), twin.draw(s.hidden, s.heads * s.head_dim)
    x = rp.rms_norm(h)
    q = rp.rotate(rp.rms_norm((x @ wq.T).view(t, s.heads, -1)), pos, s.rope_theta)
    k = rp.rotate(rp.rms_norm((x @ wk.T).view(t, s.kv_heads, -1)), pos, s.rope_theta)
    v = (x @ wv.T).view(t, s.kv_heads, -1)
    rep = s.heads // s.kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True)  # fmt: skip
    torch.testing.assert_close(out, ref.transpose(0, 1).reshape(t, -1) @ wo.T)


def test_experts_sum_each_tokens_routed_swiglus(rng_seed):
    model = rp.RandomDecoder(TINY, std=0.1, seed=rng_seed)
    twin = rp.RandomDecoder(TINY, std=0.1, seed=rng_seed)
    gen = torch.Generator().manual_seed(rng_seed + 1)
    state = torch.randn(5, TINY.hidden, generator=gen)
    weights, routed = rp.route(state, torch.randn(TINY.experts, TINY.hidden, generator=gen), 3)
    out = model.experts(state, weights, routed)
    drawn = [(twin.draw(TINY.expert_width, TINY.hidden), twin.draw(TINY.expert_width, TINY.hidden),
              twin.draw(TINY.hidden, TINY.expert_width)) for _ in range(TINY.experts)]  # fmt: skip
    x = rp.rms_norm(state)
    for t in range(5):
        ref = sum(w * ((F.silu(x[t] @ drawn[e][0].T) * (x[t] @ drawn[e][1].T)) @ drawn[e][2].T)
                  for w, e in zip(weights[t], routed[t].tolist(), strict=True))  # fmt: skip
        torch.testing.assert_close(out[t], ref)


def test_the_command_writes_a_row_per_predicted_layer(tmp_path, rng_seed):
    out = tmp_path / "rows.json"
    rp.main(["--layers", "3", "--tokens", "12", "--scale", "16", "--seed", str(rng_seed % 1000),
             "--out", str(out)])  # fmt: skip
    report = json.loads(out.read_text())
    assert [r["layer"] for r in report["rows"]] == [1, 2]
    assert all(0 <= r["recall"] <= 1 and r["new_caught"] <= r["new_pairs"] for r in report["rows"])
    assert report["wasted"] == sum(r["wasted"] for r in report["rows"])
    assert report["new_pairs"] == sum(r["new_pairs"] for r in report["rows"])
    assert report["shape"]["hidden"] == 2048 // 16
