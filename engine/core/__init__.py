"""The ground floor: the data one step passes from stage to stage, and the counters that add it
up. Nothing here imports anything above it (tests/unit/test_layers.py holds it to that)."""
