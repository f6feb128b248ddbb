"""Three of the soak's seeded fault schedules (``make soak`` runs 20): a SIGKILL inside a sync's
collectives with a restart that rejoins, a SIGKILL between syncs, and a collective that fails
on every replica. Each against the real lighthouse; see :mod:`oktopk_triton.bench.ft_soak`."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torchft")

from oktopk_triton.bench.ft_soak import KINDS, schedule  # noqa: E402


def test_the_schedules_are_seeded_and_cover_every_kind():
    assert schedule(7) == schedule(7)
    assert {schedule(s)["kind"] for s in range(5)} == set(KINDS)
    # every kind runs with one fragment and as Streaming DiLoCo's two (within 10 seeds)
    assert {(schedule(s)["kind"], schedule(s)["fragments"]) for s in range(10)} == {
        (k, f) for k in KINDS for f in (1, 2)}
    for s in range(20):
        f = schedule(s)
        assert 0 <= f["victim"] < 3 and 2 <= f["sync"] < f["rejoin_at"]


@pytest.mark.slow
def test_a_soak_schedule_end_to_end(tmp_path):
    """The soak's command line on the one kind no other test runs against the real lighthouse:
    a replica SIGKILLed between syncs (a kill inside a sync with a rejoin, and a failed commit,
    run in tests/test_torchft_integration.py; every kind's judging in
    tests/test_ft_harness_inprocess.py; all 20 in make soak)."""
    out = tmp_path / "soak.json"
    scratch = tmp_path / "tmp"               # the soak's temporary directory goes here
    scratch.mkdir()
    proc = subprocess.run([sys.executable, "-m", "oktopk_triton.bench.ft_soak", "--seeds", "2",
                           "--jobs", "1", "--json", str(out)],
                          env=dict(os.environ, TMPDIR=str(scratch)),
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = json.loads(out.read_text())["schedules"]
    assert [r["kind"] for r in recs] == ["kill-between"]
    assert recs[0]["ok"] and recs[0]["max_relative_error"] <= 1e-6, recs[0]
    assert not list(scratch.glob("oktopk-soak-*"))       # and leaves no working directory
