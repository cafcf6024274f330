"""The speculation policy: `python -m bench.policy` (run.py) compares modes off / always / auto
over HTTP; beside it the policy's other benches, each `python -m bench.policy.<name>`: cost,
offline, lookup_ceiling, step_trace and humaneval.

run.py's parts: settings.py (its flags), clients.py (the load), workload.py (the prompts),
measurements.py (per request and per level), counters.py (the server's Prometheus counters),
report.py (tables, targets and the plot).
"""
