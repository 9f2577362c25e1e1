"""The benchmark suite of django-pgjobs: ``make bench`` runs ``benchmarks.run``.

A script, not a test: it prints tables of medians and writes raw figures to
``benchmarks/results/``. Nothing here asserts speed.
"""
