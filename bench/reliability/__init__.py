"""Reliability of a real `specserve serve` under churn, a soak and a fuzzer:
`python -m bench.reliability` (run.py; workload.py, server.py, fuzz.py, report.py its parts).
"""
