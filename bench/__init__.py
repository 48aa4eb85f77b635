"""Benchmarks of the sbd ops against the baselines a user would otherwise use (see bench/common.py)."""
