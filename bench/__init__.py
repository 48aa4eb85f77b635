"""Benchmarks of the sbd ops against the baselines a user would otherwise use (see bench/harness.py); run
them with `sbd bench`. Not part of the installed package: they import it, it never imports them."""
