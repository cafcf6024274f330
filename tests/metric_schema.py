"""The series the server exports: one list for the metrics tests and the deployment tests."""

from __future__ import annotations

# The series the server exports (prefix specserve:, label model_name), as Prometheus names them.
GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "spec_decode_requests_speculating",
    "spec_decode_requests_decoding",
)
COUNTERS = (
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "engine_steps",
    "overlapped_steps",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
    "spec_decode_num_draft_tokens_by_method",
    "spec_decode_num_accepted_tokens_by_method",
    "spec_decode_policy_decisions",
    "spec_decode_mode_seconds",
    "spec_decode_mode_generation_tokens",
    "spec_decode_num_cut_by_stop_tokens",
    "spec_decode_num_prediction_accepted_tokens",
    "spec_decode_num_prediction_rejected_tokens",
    "stream_stalls",  # the HTTP layer's (server/connections.py)
)
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "spec_decode_draft_tokens_per_step",
    "spec_decode_draft_time_seconds",
    "spec_decode_verify_time_seconds",
)
EXPORTED = frozenset(
    [f"specserve:{name}" for name in GAUGES]
    + [f"specserve:{name}_total" for name in COUNTERS]
    + [
        f"specserve:{name}{suffix}"
        for name in HISTOGRAMS
        for suffix in ("_bucket", "_sum", "_count")
    ]
)
