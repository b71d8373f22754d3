"""Benchmarks, one script per question (``python -m experiments.bench.<name> --help``); their figures go to
experiments/LOG.md with the command that produced them. Knows nothing about training.
"""
