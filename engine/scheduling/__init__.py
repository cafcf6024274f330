"""Token-budget continuous batching: the scheduler and the paged-KV block manager it owns."""
