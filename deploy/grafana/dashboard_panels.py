"""The panels of specserve's Grafana dashboard, as data: each row's panels with their title,
PromQL, unit and size, and the PromQL helpers they are written with. build_dashboard.py lays
them out on Grafana's grid and writes the JSON; keeping the queries here lets them read as a
list, apart from the JSON plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEL = '{model_name=~"$model_name"}'  # every query's selector
WINDOW = "[$__rate_interval]"


def rate(series: str, by: str = "model_name") -> str:
    """Per-second rate of a counter summed over instances, kept apart by `by`."""
    return f"sum by ({by}) (rate(specserve:{series}{SEL}{WINDOW}))"


def quantile(q: float, histogram: str, by: str = "model_name") -> str:
    """The q-quantile of a histogram over the rate window."""
    buckets = f"sum by (le, {by}) (rate(specserve:{histogram}_bucket{SEL}{WINDOW}))"
    return f"histogram_quantile({q}, {buckets})"


def mean(histogram: str) -> str:
    """The mean observation of a histogram over the rate window."""
    return f"{rate(histogram + '_sum')} / {rate(histogram + '_count')}"


def gauge(series: str) -> str:
    return f"sum by (model_name) (specserve:{series}{SEL})"


@dataclass(frozen=True)
class Query:
    """One PromQL target and its legend."""

    expr: str
    legend: str = "{{model_name}}"
    heatmap: bool = False


@dataclass(frozen=True)
class Panel:
    """One panel: `kind` is a Grafana panel type (timeseries, stat, heatmap)."""

    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    description: str = ""
    stacked: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def _latency(title: str, histogram: str, description: str) -> Panel:
    return Panel(
        title,
        tuple(
            Query(quantile(q, histogram), f"p{round(q * 100)} {{{{model_name}}}}")
            for q in (0.5, 0.99)
        ),
        unit="s",
        description=description,
    )


ACCEPTANCE_RATE = (
    f"{rate('spec_decode_num_accepted_tokens_total')}"
    f" / {rate('spec_decode_num_draft_tokens_total')}"
)


MEAN_ACCEPTANCE_LENGTH = (
    f"1 + {rate('spec_decode_num_accepted_tokens_total')} / {rate('spec_decode_num_drafts_total')}"
)


SHARE_SPECULATING = (
    f"{gauge('spec_decode_requests_speculating')} / {gauge('spec_decode_requests_decoding')}"
)


OVERVIEW = (
    Panel(
        "Generated tokens/s",
        (Query(f"sum({rate('generation_tokens_total')})", "tokens/s"),),
        unit="short",
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Running requests",
        (Query(f"sum({gauge('num_requests_running')})", "running"),),
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Waiting requests",
        (Query(f"sum({gauge('num_requests_waiting')})", "waiting"),),
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "KV cache usage",
        (Query(f"max({gauge('kv_cache_usage_perc')})", "KV"),),
        unit="percentunit",
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Draft acceptance rate",
        (Query(f"avg({ACCEPTANCE_RATE})", "acceptance"),),
        unit="percentunit",
        kind="stat",
        width=4,
        height=4,
    ),
    Panel(
        "Mean acceptance length",
        (Query(f"avg({MEAN_ACCEPTANCE_LENGTH})", "tokens/verify"),),
        kind="stat",
        width=4,
        height=4,
    ),
)


SERVING = (
    _latency(
        "Time to first token",
        "time_to_first_token_seconds",
        "From arrival to the first generated token.",
    ),
    _latency(
        "Inter-token latency",
        "inter_token_latency_seconds",
        "Between consecutive output tokens of a request (a verify step that accepts several "
        "tokens spreads its time over them).",
    ),
    _latency(
        "End-to-end request latency",
        "e2e_request_latency_seconds",
        "From arrival to the last token.",
    ),
    Panel(
        "Token throughput",
        (
            Query(rate("generation_tokens_total"), "generated {{model_name}}"),
            Query(rate("prompt_tokens_total"), "prompt {{model_name}}"),
        ),
        unit="short",
        description="Tokens per second.",
    ),
    Panel(
        "Requests running and waiting",
        (
            Query(gauge("num_requests_running"), "running {{model_name}}"),
            Query(gauge("num_requests_waiting"), "waiting {{model_name}}"),
        ),
        description="Waiting requests are what the HorizontalPodAutoscaler scales on.",
    ),
    Panel(
        "KV cache usage",
        (Query(gauge("kv_cache_usage_perc")),),
        unit="percentunit",
        options={"max": 1, "min": 0},
    ),
    Panel(
        "Preemptions",
        (Query(rate("num_preemptions_total")),),
        unit="short",
        description="Requests preempted (recomputed later) per second: the KV pool ran dry.",
    ),
    Panel(
        "Finished requests by reason",
        (
            Query(
                rate("request_success_total", "model_name, finished_reason"),
                "{{finished_reason}} {{model_name}}",
            ),
        ),
        unit="reqps",
        stacked=True,
    ),
    Panel(
        "Stalled streams cut",
        (Query(rate("stream_stalls_total")),),
        unit="short",
        description="Responses cut per second because the client read nothing for "
        "stream_stall_timeout seconds (their requests are aborted).",
    ),
    _latency(
        "Queue time",
        "request_queue_time_seconds",
        "From arrival to the first scheduled step.",
    ),
    Panel(
        "Prefix cache hit rate",
        (
            Query(
                f"{rate('prefix_cache_hits_total')} / {rate('prefix_cache_queries_total')}",
            ),
        ),
        unit="percentunit",
        width=12,
        height=6,
        description="Prompt blocks found in the prefix cache, per block looked up.",
    ),
    Panel(
        "Overlapped steps",
        (Query(f"{rate('overlapped_steps_total')} / {rate('engine_steps_total')}"),),
        unit="percentunit",
        width=12,
        height=6,
        description="Engine steps read back after the next step was launched (overlap "
        "scheduling): the host's work of those steps ran while the device computed. Steps that "
        "draft, or have a grammar or penalty row, run in series.",
    ),
)


SPECULATION = (
    Panel(
        "Draft acceptance rate",
        (Query(ACCEPTANCE_RATE),),
        unit="percentunit",
        description="Accepted draft tokens per draft token verified (the bonus token excluded).",
    ),
    Panel(
        "Mean acceptance length",
        (Query(MEAN_ACCEPTANCE_LENGTH),),
        description="Tokens a verify step yields per request on average: 1 + accepted per draft.",
    ),
    Panel(
        "Acceptance by draft position",
        (
            Query(
                f"{rate('spec_decode_num_accepted_tokens_per_pos_total', 'model_name, position')}"
                f" / on (model_name) group_left {rate('spec_decode_num_drafts_total')}",
                "position {{position}} {{model_name}}",
            ),
        ),
        unit="percentunit",
        description="Share of drafts whose token at this position (1-based) was accepted.",
    ),
    Panel(
        "Acceptance by draft method",
        (
            Query(
                f"{rate('spec_decode_num_accepted_tokens_by_method_total', 'model_name, method')}"
                f" / {rate('spec_decode_num_draft_tokens_by_method_total', 'model_name, method')}",
                "{{method}} {{model_name}}",
            ),
        ),
        unit="percentunit",
        description="Share of each draft source's tokens accepted (ngram, draft_model, eagle3, "
        "prediction, grammar).",
    ),
    Panel(
        "Draft tokens per step",
        (
            Query(
                "sum by (le) (increase(specserve:spec_decode_draft_tokens_per_step_bucket"
                f"{SEL}{WINDOW}))",
                "{{le}}",
                heatmap=True,
            ),
        ),
        kind="heatmap",
        description="k granted per decoding request per step (0: speculation off for it).",
    ),
    Panel(
        "Draft tokens per step (quantiles)",
        tuple(
            Query(
                quantile(q, "spec_decode_draft_tokens_per_step"),
                f"p{round(q * 100)} {{{{model_name}}}}",
            )
            for q in (0.5, 0.9)
        )
        + (Query(mean("spec_decode_draft_tokens_per_step"), "mean {{model_name}}"),),
    ),
    Panel(
        "Share of decoding requests speculating",
        (Query(SHARE_SPECULATING),),
        unit="percentunit",
        options={"max": 1, "min": 0},
        description="Decoding requests granted k > 0 in the latest step.",
    ),
    Panel(
        "Policy decisions by reason",
        (
            Query(
                rate("spec_decode_policy_decisions_total", "decision, reason"),
                "{{decision}}: {{reason}}",
            ),
        ),
        unit="short",
        stacked=True,
        width=12,
        description="Per-request speculation decisions per second, and why.",
    ),
    Panel(
        "Generated tokens per step-second, by mode",
        (
            Query(
                f"{rate('spec_decode_mode_generation_tokens_total', 'mode')}"
                f" / {rate('spec_decode_mode_seconds_total', 'mode')}",
                "{{mode}}",
            ),
        ),
        unit="short",
        width=12,
        description="What each speculation mode earns while the engine runs in it (tokens over "
        "the seconds of its steps): after an operator's switch, the modes side by side.",
    ),
    Panel(
        "Draft vs verify time per step",
        (
            Query(mean("spec_decode_draft_time_seconds"), "draft mean {{model_name}}"),
            Query(mean("spec_decode_verify_time_seconds"), "verify mean {{model_name}}"),
            Query(quantile(0.99, "spec_decode_draft_time_seconds"), "draft p99 {{model_name}}"),
            Query(quantile(0.99, "spec_decode_verify_time_seconds"), "verify p99 {{model_name}}"),
        ),
        unit="s",
        width=12,
        description="Proposer time per step that drafted; target forward plus verification per "
        "step with drafts.",
    ),
    Panel(
        "Predicted outputs",
        (
            Query(
                rate("spec_decode_num_prediction_accepted_tokens_total"),
                "accepted {{model_name}}",
            ),
            Query(
                rate("spec_decode_num_prediction_rejected_tokens_total"),
                "rejected {{model_name}}",
            ),
            Query(rate("spec_decode_num_cut_by_stop_tokens_total"), "cut by stop {{model_name}}"),
        ),
        unit="short",
        width=24,
        height=6,
        description="Draft tokens per second from requests' `prediction`, and accepted drafts "
        "dropped because a stop condition ended the output.",
    ),
)


ROWS = (("Overview", OVERVIEW), ("Serving", SERVING), ("Speculative decoding", SPECULATION))
