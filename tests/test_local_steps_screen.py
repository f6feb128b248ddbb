"""tools/local_steps_screen.py: rows against dense of the same seed (synthetic records)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import local_steps_screen as screen  # noqa: E402


def _run(alg, seed, final, bytes_per_step, curve, density=1.0):
    return {"algorithm": alg, "seed": seed, "density": density, "steps": 1200,
            "final_val_loss": final, "bytes_per_step": bytes_per_step, "val_curve": curve,
            "replicas_identical": True}


def test_rows(tmp_path):
    curve = [[0, 4.0], [600, 2.0], [1200, 1.0]]
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps({"git": "abc", "runs": [_run("dense", 0, 1.0, 1000.0, curve)]}))
    d = tmp_path / "screen"
    d.mkdir()
    (d / "oktopk-H4.json").write_text(json.dumps({
        "commit": "def", "dirty": False, "config": {"options": {"sync_every": 4,
                                                                "wire_format": "compact"}},
        "runs": [_run("oktopk", 0, 2.0, 20.0, curve, density=0.08)]}))
    (r,) = screen.rows(str(d), str(dense))
    assert r["sync_every"] == 4 and r["wire_format"] == "compact"
    assert r["bytes_vs_dense"] == pytest.approx(0.02)
    assert r["steps_ratio"] == pytest.approx(2.0)        # dense reached 2.0 at step 600
    assert r["loss_vs_dense_pct"] == pytest.approx(100.0)
    with pytest.raises(SystemExit, match="seed 1"):
        screen.dense_run(str(dense), 1)
