"""Structured outputs: `python -m bench.structured` (run.py) decodes json_schema output on the
model; `python -m bench.structured.grammar_mask` times the grammar libraries alone. Both take
their cases from workload.py.
"""
