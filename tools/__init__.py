"""Repository tooling (not installed): GPU checks, result tables, the README example loop;
research probes and campaign scripts in :mod:`tools.research`."""
