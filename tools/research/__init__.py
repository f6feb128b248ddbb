"""Research probes and campaign scripts (not installed; see README.md here). Run from the
repository root as ``python -m tools.research.<probe>``."""
