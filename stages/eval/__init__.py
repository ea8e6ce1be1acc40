"""Evaluation: serving, benchmarks, tool-integrated inference, scoring (rules, judge, pass@k), report."""
