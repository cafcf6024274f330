"""Training draft models for speculative decoding (`specserve train-eagle3`)."""
