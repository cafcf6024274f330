"""specserve against llama.cpp's server and vLLM-CPU: `python -m bench.peers` (run.py).

install.py and setup.py put the peers in place (`python -m bench.peers.setup STEP`),
process.py watches a server's process tree, report.py writes the table.
"""
