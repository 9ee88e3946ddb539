"""Diagnostics: scripts that say where the time of a workload goes (see ../README.md)."""
