"""tools/research/local_steps_screen.py: rows against dense of the same seed and steps,
configurations averaged over seeds (synthetic records)."""
import json

import pytest

from tools.research import local_steps_screen as screen

pytestmark = pytest.mark.research


def _run(alg, seed, final, bytes_per_step, curve, density=1.0, steps=1200, conservation=None):
    return {"algorithm": alg, "seed": seed, "density": density, "steps": steps,
            "final_val_loss": final, "bytes_per_step": bytes_per_step, "val_curve": curve,
            "replicas_identical": True, "conservation": conservation}


def _write(path, runs, size=None, **opts):
    config = {"options": opts, **({"size": size} if size else {})}
    path.write_text(json.dumps({"commit": "def", "dirty": False, "config": config,
                                "runs": runs}))


def test_rows_and_configurations(tmp_path):
    curve = [[0, 4.0], [600, 2.0], [1200, 1.0]]
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"git": "abc", "runs": [
        _run("dense", 0, 1.0, 1000.0, curve), _run("dense", 1, 1.0, 1000.0,
                                                   [[0, 4.0], [600, 3.0], [1200, 1.0]])]}))
    d = tmp_path / "screen"
    d.mkdir()
    ok = {"checked": True, "relative_error": 3e-8}
    _write(d / "oktopk-H4.json", [_run("oktopk", 0, 2.0, 20.0, curve, 0.08, conservation=ok)],
           sync_every=4, wire_format="compact")
    _write(d / "oktopk-H4-s1.json", [_run("oktopk", 1, 2.0, 20.0, curve, 0.08)],
           sync_every=4, wire_format="compact")
    _write(d / "dense-H4-lr2.json", [_run("dense", 0, 1.5, 250.0, curve)],
           sync_every=4, outer_lr=2.0)
    _write(d / "dense-H4-ms1.json", [_run("dense", 0, 1.2, 750.0, curve)],
           sync_every=4, moment_sync_every=1, moment_sync="first", moment_dtype="bf16")
    _write(d / "oktopk-H4-msf.json", [_run("oktopk", 0, 1.2, 20.0, curve, 0.06)],
           sync_every=4, moment_sync_every=1, moment_sync="first", moment_density=0.02)
    _write(d / "oktopk-H4-ra.json", [_run("oktopk", 0, 1.9, 20.0, curve, 0.08)],
           sync_every=4, wire_format="compact", moment_realign=0.5)
    rs = {r["tag"]: r for r in screen.rows(str(d), str(dense))}
    assert rs["oktopk-H4-ra"]["outer"] == "realign 0.5"       # not pooled with plain H4
    assert rs["oktopk-H4-msf"]["outer"] == "moments first at 0.02 every 1"
    r = rs["oktopk-H4"]
    assert r["sync_every"] == 4 and r["wire_format"] == "compact" and r["outer"] == "-"
    assert r["bytes_vs_dense"] == pytest.approx(0.02)
    assert r["steps_ratio"] == pytest.approx(2.0)        # dense reached 2.0 at step 600
    assert r["loss_vs_dense_pct"] == pytest.approx(100.0)
    assert r["conservation"] == 3e-8 and rs["oktopk-H4-s1"]["conservation"] is None
    assert rs["oktopk-H4-s1"]["steps_ratio"] == pytest.approx(1200 / 900)   # seed 1's dense
    assert rs["dense-H4-lr2"]["outer"] == "lr 2"
    assert rs["dense-H4-ms1"]["outer"] == "moments first bf16 every 1"   # its own configuration
    cs = {(c["algorithm"], c["outer"]): c for c in screen.configurations(list(rs.values()))}
    assert ("dense", "moments first bf16 every 1") in cs and ("dense", "lr 2") in cs
    c = cs[("oktopk", "-")]
    assert c["seeds"] == [0, 1] and c["conservation_checked"] == 1
    # the mean final loss (2.0) against dense's mean curve (4, 2.5, 1): crossed at step 800
    assert c["steps_ratio"] == pytest.approx(1200 / 800)
    with pytest.raises(SystemExit, match="seed 2, over 1200 steps"):
        screen.dense_run(str(dense), 2)


def test_a_dense_run_in_the_folder_is_the_reference_of_its_length(tmp_path, capsys):
    curve = [[0, 4.0], [2400, 2.0], [4800, 1.0]]
    d = tmp_path / "screen"
    d.mkdir()
    _write(d / "dense-4800.json", [_run("dense", 0, 1.0, 1000.0, curve, steps=4800)])
    _write(d / "oktopk-4800.json", [_run("oktopk", 0, 2.0, 20.0, curve, 0.08, steps=4800)],
           sync_every=4)
    (r,) = screen.rows(str(d), None)                     # the dense run is not a row
    assert r["steps_ratio"] == pytest.approx(2.0)
    _write(d / "oktopk-600.json", [_run("oktopk", 0, 2.0, 20.0, curve, 0.08, steps=600)])
    with pytest.raises(SystemExit, match="seed 0, over 600 steps"):
        screen.rows(str(d), None)


def test_each_model_preset_has_its_own_dense_reference(tmp_path):
    """A 4m run of seed 0 over 1200 steps is measured against the 4m dense run, not the 1m one
    of the same seed and length (records without a preset are the 1m default)."""
    d = tmp_path / "screen"
    d.mkdir()
    _write(d / "dense-1m.json", [_run("dense", 0, 1.0, 1000.0, [[0, 4.0], [1200, 1.0]])])
    _write(d / "dense-4m.json", [_run("dense", 0, 0.5, 4000.0, [[0, 4.0], [1200, 0.5]])],
           size="4m")
    _write(d / "ok-1m.json", [_run("oktopk", 0, 2.0, 20.0, [], 0.08)], sync_every=4)
    _write(d / "ok-4m.json", [_run("oktopk", 0, 2.0, 80.0, [], 0.08)], size="4m", sync_every=4)
    rs = {r["tag"]: r for r in screen.rows(str(d), None)}
    assert rs["ok-1m"]["model"] == "1m" and rs["ok-4m"]["model"] == "4m"
    assert rs["ok-1m"]["bytes_vs_dense"] == pytest.approx(0.02)
    assert rs["ok-4m"]["bytes_vs_dense"] == pytest.approx(0.02)
    assert rs["ok-1m"]["steps_ratio"] == pytest.approx(1200 / 800)     # 1m dense: 2.0 at 800
    assert rs["ok-4m"]["steps_ratio"] == pytest.approx(1200 / 685.714, rel=1e-4)  # 4m: at 686
    assert {c["model"] for c in screen.configurations(list(rs.values()))} == {"1m", "4m"}
    _write(d / "ok-25m.json", [_run("oktopk", 0, 2.0, 80.0, [], 0.08)], size="25m")
    with pytest.raises(SystemExit, match="no dense run of the 25m model"):
        screen.rows(str(d), None)
