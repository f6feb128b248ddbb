"""The oktopk-bench entry point: help works at every level, and a subcommand's module is imported
only when that subcommand runs."""
import subprocess
import sys

import pytest

from oktopk_triton import cli


def test_top_level_help_lists_every_subcommand():
    r = subprocess.run([sys.executable, "-m", "oktopk_triton.cli", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in cli.SUBCOMMANDS:
        assert name in r.stdout


@pytest.mark.parametrize("command", sorted(cli.SUBCOMMANDS))
def test_subcommand_help(command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0


def test_only_the_chosen_module_is_imported(monkeypatch):
    imported = []
    real = cli.importlib.import_module
    monkeypatch.setattr(cli.importlib, "import_module",
                        lambda name: imported.append(name) or real(name))
    cli.build_parser("kernels")
    assert imported == ["oktopk_triton.bench.kernels"]


def test_unknown_subcommand_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        cli.main(["no-such-command"])
    assert e.value.code == 2
