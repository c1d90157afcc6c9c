"""Simulator tests (a package, so module names do not clash with tests/ at the top)."""
