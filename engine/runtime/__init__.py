"""What the engine's process runs on: the device object every tensor and timing goes through,
the cache directory, and the timed start-up log."""
