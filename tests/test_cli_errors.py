"""Every bad ``oktopk-bench`` value: one clear line on stderr and exit status 2, no traceback,
nothing started."""
import os

import pytest

from oktopk_triton.cli import main

CASES = [
    ("kernels --n -5", "--n"), ("kernels --n 0", "--n"), ("kernels --density 2", "--density"),
    ("kernels --density 0", "--density"), ("kernels --density -1", "--density"),
    ("kernels --repeats 0", "--repeats"), ("kernels --warmup -1", "--warmup"),
    ("kernels --n abc", "--n"),
    ("collectives --density 2", "--density"), ("collectives --steps 1", "--warmup"),
    ("collectives --world-sizes 0", "--world-sizes"), ("collectives --n 0", "--n"),
    ("train --world-size 0", "--world-size"), ("train --epochs 0", "--epochs"),
    ("train --density 2", "--density"), ("train --lr -1", "--lr"),
    ("train --momentum 1.5", "--momentum"), ("train --steps 0", "--steps"),
    ("demo --density 0", "--density"),
    ("ddp --world-size 0", "--world-size"), ("ddp --density 1.5", "--density"),
    ("project --density 0", "--density"), ("project --n -3", "--n"),
    ("project --net 1Gbps", "--net"), ("project --steps-ratio oktopk", "--steps-ratio"),
    ("project --steps-ratio oktopk=0", "--steps-ratio"),
    ("project --compute-ms -1", "--compute-ms"),
    ("train --powersgd-start 0", "--powersgd-start"),
    ("train --algorithms oktopk --option foo=1", "--option"),
    ("train --algorithms dense topka --option moment_masking=1", "--option"),
    ("train --algorithms oktopk --option warmup_steps", "--option"),
    ("train --model gpt --algorithms oktopk --option sync_every=0", "sync_every"),
    ("train --model gpt --algorithms dense --option outer_lr=0", "outer_lr"),
    ("train --algorithms oktopk --option sync_every=4", "--model gpt"),
    ("train --model gpt --reduce gradients --algorithms oktopk --option sync_every=4",
     "--reduce updates"),
    ("train --model gpt --algorithms oktopk powersgd --option sync_every=4", "powersgd"),
]


@pytest.mark.parametrize("line,option", CASES)
def test_bad_value_is_one_line(line, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(line.split())
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0] and option in err[0], err


def test_json_under_a_file_and_cuda_without_one(tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("")
    for line in (f"kernels --json {f}/x.json", f"collectives --json {f}/x.json"):
        with pytest.raises(SystemExit) as e:
            main(line.split())
        assert e.value.code == 2 and "is a file" in capsys.readouterr().err
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["kernels", "--device", "cuda"])
        assert "no CUDA" in capsys.readouterr().err


def test_demo_help_shows_a_plain_percent(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "1%%" not in capsys.readouterr().out
    assert os.environ.get("PYTEST_CURRENT_TEST")


@pytest.mark.parametrize("line", ["train --algorithms nope", "collectives --algorithms nope",
                                  "project --algorithms nope", "ddp --algorithms dense nope",
                                  "train --model gpt --algorithms powersgd nope"])
def test_unknown_algorithm_is_one_line_naming_the_choices(line):
    """Every benchmark resolves --algorithms in one place: one line naming the command, the name
    and the choices, before anything is launched."""
    with pytest.raises(SystemExit) as e:
        main(line.split())
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "unknown algorithm 'nope'" in msg, msg
    assert msg.startswith(f"oktopk-bench {line.split()[0]}:") and "'oktopk'" in msg, msg
    assert ("'powersgd'" in msg) == line.startswith("train"), msg
