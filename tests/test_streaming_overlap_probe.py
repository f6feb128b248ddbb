"""tools/research/streaming_overlap.py: an interval's wall time from a replica's step times, and
the ``local`` mode of the fault tests' replica (the inner steps alone) that it compares with."""
import pytest

from oktopk_triton.bench import ft_replica
from tools.research import streaming_overlap as probe

pytestmark = pytest.mark.research


def test_intervals_are_read_from_the_step_times_after_the_warm_up():
    times = [0.0] + [float(i) for i in range(1, 17)]          # one second a step, 16 steps
    assert probe.intervals(times, skip=0) == [4.0, 4.0, 4.0, 4.0]
    assert probe.intervals(times) == [4.0, 4.0]
    assert probe.intervals([0.0, 1.0, 2.0]) == []
    assert probe.intervals(times, interval=8, skip=0) == [8.0, 8.0]


def test_the_overlapped_run_delays_as_far_as_torchft_allows():
    assert probe.runs(8)["overlapped"]["fragment_sync_delay"] == 3
    assert probe.runs(16)["overlapped"]["fragment_sync_delay"] == 7
    assert probe.runs(16)["blocking"]["fragment_sync_delay"] == 0
    with pytest.raises(SystemExit):
        probe.main(["--sync-every", "5"])


def test_the_local_mode_trains_the_inner_steps_alone():
    cfg = {**ft_replica.DEFAULTS, "mode": "local", "replica": 0, "syncs": 3, "sync_every": 4,
           "fragments": 2}
    out = {}
    ft_replica.run_local(cfg, out)
    assert len(out["step_times"]) == 1 + 3 * 4 // 2 and out["history"] == []
    assert out["step_times"] == sorted(out["step_times"])
