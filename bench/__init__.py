"""The benches, run from the repository root as `python -m bench.<name>` (docs/performance.md).

A bench of several modules is a package whose `python -m bench.<name>` runs its run.py: peers,
policy, reliability, structured; a single bench is a module here (attention, decode, drafters,
eagle3_cost, kernels, lossless, spec, throughput). bench/common/ holds what they share; their
result files live in bench/results/.
"""
