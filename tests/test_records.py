"""The one result record (bench/records.py), the shared measurements (bench/measure.py) and the
ring-allreduce byte formula's one home (comm/base.py)."""
import json

import pytest

from oktopk_triton.bench import measure, records
from oktopk_triton.comm import ring_allreduce_bytes


def test_header_splits_the_dirty_marker_and_records_the_arguments(monkeypatch):
    monkeypatch.setattr(records, "git_commit", lambda: "abc123-dirty")
    monkeypatch.setenv("NCCL_HOSTID", "h0")
    h = records.header("demo", {"n": 4, "_private": 1})
    assert set(records.HEADER_KEYS) <= set(h)
    assert (h["benchmark"], h["commit"], h["dirty"]) == ("demo", "abc123", True)
    assert h["arguments"] == {"n": 4} and h["env"]["NCCL_HOSTID"] == "h0"
    monkeypatch.setattr(records, "git_commit", lambda: None)     # outside a checkout
    assert (records.header("demo")["commit"], records.header("demo")["dirty"]) == (None, None)


def test_old_files_read_like_new_ones(tmp_path):
    (tmp_path / "train-x.json").write_text(json.dumps({"git": "f00-dirty", "runs": []}))
    (tmp_path / "ddp-y.json").write_text(json.dumps({"benchmark": "ddp", "git_commit": "bar"}))
    (tmp_path / "lm-z.json").write_text(json.dumps({"git": ["a", "b-dirty"]}))
    new = {**records.header("kernels"), "rows": [1]}
    records.write(str(tmp_path / "sub" / "k.json"), new)
    t = records.read(str(tmp_path / "train-x.json"))
    assert (t["benchmark"], t["commit"], t["dirty"]) == ("train", "f00", True)
    d = records.read(str(tmp_path / "ddp-y.json"))
    assert (d["benchmark"], d["commit"], d["dirty"]) == ("ddp", "bar", False)
    m = records.read(str(tmp_path / "lm-z.json"))
    assert m["commit"] == ["a", "b"] and m["dirty"] is True and m["benchmark"] == "lm-merge"
    assert records.read(str(tmp_path / "sub" / "k.json"))["rows"] == [1]
    idx = records.index(str(tmp_path))
    assert [(e["file"], e["benchmark"]) for e in idx] == [
        ("ddp-y.json", "ddp"), ("lm-z.json", "lm-merge"), ("sub/k.json", "kernels"),
        ("train-x.json", "train")]


def test_one_folder_per_benchmark(monkeypatch, tmp_path):
    monkeypatch.setenv(records.RESULTS_ENV, str(tmp_path))
    assert records.results_path("gpu-kernels-x.json") == str(tmp_path / "kernels" /
                                                              "gpu-kernels-x.json")
    assert records.folder_of("gpu-kernel-variants-call1.json") == "kernels"
    assert records.folder_of("a/gpu-collectives-P4.json") == "collectives"
    assert (records.folder_of("lm-a.json"), records.folder_of("techniques-b.json")) == (
        "lm", "techniques")
    assert records.folder_of("notes.json") == ""


def test_merge_by_key_keeps_the_later_in_the_earlier_place():
    a = [{"k": 1, "v": "a"}, {"k": 2, "v": "b"}]
    b = [{"k": 1, "v": "c"}, {"k": 3, "v": "d"}]
    assert records.merge(a + b, key=lambda r: r["k"]) == [
        {"k": 1, "v": "c"}, {"k": 2, "v": "b"}, {"k": 3, "v": "d"}]


def test_table_plain_and_markdown():
    rows = [{"a": "x", "b": 1.5}, {"a": "long name", "b": 10.25}]
    cols = [("name", lambda r: r["a"]), ("value", lambda r: f"{r['b']:.2f}")]
    plain = records.table(rows, cols).splitlines()
    assert plain[0] == "name      | value" and plain[1] == "----------+------"
    assert plain[2] == "x         |  1.50"
    md = records.table(rows, cols, markdown=True).splitlines()
    assert md[:3] == ["| name | value |", "|---|---|", "| x | 1.50 |"]


def test_step_stats_take_the_slowest_rank_and_ring_bytes():
    st = measure.step_stats([[9.0, 0.010, 0.030], [9.0, 0.020, 0.010]], [1, 2])
    assert st["step_s"] == [9.0, 0.020, 0.030]
    assert abs(st["ms_mean"] - 25.0) < 1e-9 and abs(st["ms_min"] - 20.0) < 1e-9
    assert ring_allreduce_bytes(400, 4) == 600 and ring_allreduce_bytes(400, 1) == 0
    assert ring_allreduce_bytes(4, 3) == 5          # 2(P-1)/P of 4 bytes, rounded down


def test_step_stats_median_and_spread_over_the_timed_steps():
    """The median and quartiles interpolate as numpy does and ignore the untimed steps."""
    times = [[50.0, 0.004, 0.001, 0.003, 0.002]]
    st = measure.step_stats(times, [1, 2, 3, 4])                   # 1, 2, 3, 4 ms
    assert st["ms_median"] == pytest.approx(2.5)
    assert st["ms_p25"] == pytest.approx(1.75) and st["ms_p75"] == pytest.approx(3.25)
    one = measure.step_stats(times, [2])
    assert one["ms_median"] == one["ms_p25"] == one["ms_p75"] == pytest.approx(1.0)
    odd = measure.step_stats(times, [1, 2, 4])                     # 4, 1, 2 ms
    assert odd["ms_median"] == pytest.approx(2.0) and odd["ms_mean"] == pytest.approx(7 / 3)
