"""Ratio benchmarks: each module measures in one run, prints a table and writes JSON."""
