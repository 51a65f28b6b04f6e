"""Benchmarks run by `filemq bench ...`; each runs its baseline in the same run and prints the ratio."""
