"""Benchmarks behind ``oktopk-bench``: each submodule has ``add_arguments(parser)`` and
``main(args) -> int``; :mod:`oktopk_triton.cli` wires them up as subcommands."""
