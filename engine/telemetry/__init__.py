"""What the engine counts for the exporter: serving metrics and the opt-in per-step trace."""
