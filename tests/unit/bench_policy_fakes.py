"""What a specserve server sends the policy bench, faked for its tests: one SSE chunk of a
streamed chat completion, and a /metrics page with the policy's decisions."""

from __future__ import annotations

import json


def chunk(content=None, usage=None, role=None, finish=None) -> str:
    """One `data:` line of a streamed chat completion: a delta (role, content, finish reason) or,
    given `usage`, the usage chunk that ends the stream."""
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return "data: " + json.dumps({"choices": choices, "usage": usage})


# The policy's decisions (two kinds, four reasons, one label value with an escaped quote), a
# gauge and a series without labels.
METRICS = """# HELP specserve:spec_decode_policy_decisions_total decisions
# TYPE specserve:spec_decode_policy_decisions_total counter
specserve:spec_decode_policy_decisions_total{decision="speculate",model_name="m",reason="goodput"} 7.0
specserve:spec_decode_policy_decisions_total{decision="speculate",model_name="m",reason="fixed"} 1.0
specserve:spec_decode_policy_decisions_total{decision="skip",model_name="m\\"x",reason="compute_bound"} 4.0
specserve:spec_decode_policy_decisions_total{decision="skip",model_name="m",reason="mode_off"} 2.0
specserve:num_requests_running{model_name="m"} 3.0
process_start_time_seconds 1.7e9
"""
