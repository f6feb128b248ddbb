"""``oktopk-bench diloco``: torchft's quantized allreduce on the CPU, the bytes, the arms'
settings, the goals on canned rows, and one small campaign on the real lighthouse (the tiny GPT,
two arms, fault-free) whose record, tables and PNG are checked."""
import json

import pytest
import torch

from oktopk_triton import cli
from oktopk_triton.bench import diloco, ft_gpt


def test_fp8_rows_scale_each_row_to_the_e4m3_range_and_round_trip_closely():
    t = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1e-3, 3e-3, -7e-3]])
    q = ft_gpt._fp8_rows(t)
    assert torch.equal(q[1], t[1])                       # an all-zero row stays zero
    assert q[0, 1] == -2.0 and q[2, 2] == pytest.approx(-7e-3)   # a row's largest is exact
    assert torch.allclose(q, t, rtol=2 ** -3, atol=0)    # e4m3: 3 mantissa bits
    assert not torch.equal(q, t)                         # something was rounded
    v = torch.linspace(-1, 1, 7)
    assert ft_gpt._fp8_rows(v).shape == v.shape          # a vector is one row


def test_quantized_bytes_are_one_byte_per_entry_and_a_scale_per_row():
    params = [torch.zeros(8, 5), torch.zeros(5)]
    assert ft_gpt.quantized_allreduce_bytes(params, 4) == round(1.5 * (40 + 32 + 5 + 4))
    assert ft_gpt.quantized_allreduce_bytes(params, 1) == 0
    frac = diloco.quantized_fraction("tiny", 4)
    assert 0.25 < frac < 0.3                             # a quarter, plus the scales


def test_the_cpu_quantized_allreduce_sums_the_quantized_rows(gloo1):
    import torch.distributed as dist
    from torch.distributed import ReduceOp
    t = torch.tensor([[0.3, -1.7, 2.2], [5.0, 1e-4, -3.0]])
    expect = ft_gpt._fp8_rows(ft_gpt._fp8_rows(t.clone()))
    work = ft_gpt.cpu_quantized_allreduce([t], ReduceOp.SUM, dist.group.WORLD)
    assert work.is_completed() and torch.equal(t, expect)


def test_the_learning_rate_warms_up_then_decays():
    cfg = dict(lr=1.0, syncs=10, sync_every=10, schedule="cosine")
    lrs = [ft_gpt.lr_at(cfg, i) for i in range(100)]
    assert lrs[0] == pytest.approx(1 / 20) and lrs[19] == pytest.approx(1.0)
    assert lrs[20] > lrs[60] > lrs[99] > 0
    assert ft_gpt.lr_at(dict(cfg, schedule="constant"), 50) == 1.0


def test_each_arm_sends_what_it_says():
    args = cli.build_parser("diloco").parse_args(["diloco"])
    cfgs = {a: diloco.run_config(args, a, 1, 0.27) for a in diloco.ARMS}
    assert cfgs["diloco"]["mode"] == "dense" and not cfgs["diloco"]["should_quantize"]
    assert cfgs["diloco-q"]["should_quantize"]
    assert cfgs["sparse"]["preset"] == "diloco" and cfgs["sparse=q"]["preset_bytes"] == 0.27
    assert all(c["outer_momentum"] == 0.9 and c["outer_lr"] == 0.7 and c["seed"] == 1
               for c in cfgs.values())
    assert cfgs["sparse"]["syncs"] * cfgs["sparse"]["sync_every"] == 300


def _row(arm, churn, seed, loss, nbytes):
    return {"run": arm + ("+churn" if churn else ""), "arm": arm, "churn": churn, "seed": seed,
            "final_loss": loss, "bytes_per_step": nbytes, "max_conservation_error": None,
            "syncs": 20, "rolled_back": 0, "heals": int(churn), "wall_s": 1.0}


def test_goals_compare_each_seed_and_the_churned_runs_to_their_own():
    rows = [_row("diloco", False, s, 2.6, 1000.0) for s in (0, 1)] + \
        [_row("sparse", False, 0, 2.4, 100.0), _row("sparse", False, 1, 2.7, 100.0),
         _row("sparse", True, 0, 2.45, 98.0), _row("sparse", True, 1, 2.7, 98.0)]
    agg = {r["run"]: r for r in diloco.aggregate(rows)}
    assert agg["sparse"]["bytes_vs_diloco"] == pytest.approx(0.1)
    assert agg["sparse+churn"]["churn_pct"] == pytest.approx([100 * (2.45 / 2.4 - 1), 0.0])
    g = diloco.goals(list(agg.values()), rows)
    assert g["sparse_le_diloco_each_seed"] is False          # seed 1 loses
    assert g["sparse_bytes_le_tenth"] is True
    assert g["sparse_churn_within_2pct"] is False            # +2.08% on seed 0
    assert g["sparse_q_le_diloco_q_each_seed"] is None       # not run
    text = diloco.format_tables(rows, list(agg.values()))
    assert "+2.08%" in text and "0.100" in text


def test_command_line_refusals():
    p = cli.build_parser("diloco")
    args = p.parse_args(["diloco", "--steps", "100"])
    assert "multiple of 4 x --sync-every" in diloco.check_args(args)
    args = p.parse_args(["diloco", "--arms", "sparse=q"])
    assert "name diloco-q too" in diloco.check_args(args)


@pytest.mark.slow
def test_a_small_campaign_on_the_lighthouse(tmp_path):
    out = tmp_path / "d"
    rc = cli.main(["diloco", "--size", "tiny", "--steps", "60", "--seeds", "0", "--no-churn",
                   "--arms", "diloco-q", "sparse=q", "--eval-every", "2", "--out", str(out),
                   "--timeout", "120"])
    assert rc == 0
    rec = json.loads((out / "diloco.json").read_text())
    runs = {r["run"]: r for r in rec["runs"]}
    assert set(runs) == {"diloco-q", "sparse=q"}
    assert 0.25 < rec["config"]["quantized_fraction"] < 0.3
    # equal bytes: the sparse run within 1% of the quantized DiLoCo's
    assert runs["sparse=q"]["bytes_per_step"] == pytest.approx(
        runs["diloco-q"]["bytes_per_step"], rel=0.01)
    assert runs["sparse=q"]["max_conservation_error"] <= 1e-6
    for r in runs.values():                                  # it learned
        assert r["curve"]["loss"][-1] < 0.8 * 5.5
    assert (out / "diloco.png").stat().st_size > 10_000
