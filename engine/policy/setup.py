"""The policy an engine starts with: its mode, its step-time model (calibrated on the target, or
its cached fit) and the draft model's timed forwards, from typed parts the engine has built."""

from __future__ import annotations

import logging

from engine.execution.runner import ModelRunner
from engine.policy.calibration import time_forward
from engine.policy.calibration_cache import load_or_calibrate
from engine.policy.device_monitor import make_monitor
from engine.policy.policy import SpeculationPolicy
from engine.policy.step_time import StepTimeModel
from engine.runtime.startup import startup_phase
from engine.scheduling.block_manager import BlockManager
from engine.speculative_config import DEFAULT_PREDICTION_TOKENS, SpeculativeConfig

logger = logging.getLogger(__name__)


def make_policy(
    spec: SpeculativeConfig | None,
    target: ModelRunner,
    draft_runner: ModelRunner | None,
    block_manager: BlockManager,
    max_num_batched_tokens: int,
    max_model_len: int,
) -> SpeculationPolicy:
    """The policy for the config. "auto" calibrates the step-time model (cached) and times the
    model drafter's forwards (starting points, refined online). Without a config only what a
    request brings drafts (its prediction, its grammar's forced text), and always: the client
    asked for it, and so the drafts do not depend on timings."""
    mode = spec.mode if spec else "always"
    is_calibrated = mode == "auto" and spec is not None
    draft_seconds = catch_up_per_token = 0.0
    if is_calibrated:
        with startup_phase("calibration"):  # the step-time model, or its cached fit
            step_model = load_or_calibrate(
                target,
                block_manager,
                target.model_config.path,
                max_num_batched_tokens,
                max_model_len,
            )
        if draft_runner is not None:
            with startup_phase("draft timing"):
                time_forward(draft_runner, block_manager, 1, 0, repeats=1)  # warm-up
                draft_seconds = time_forward(draft_runner, block_manager, 1, 0, repeats=2)
                n = min(64, max_model_len)
                catch_up = time_forward(draft_runner, block_manager, n, 0, repeats=1)
                catch_up_per_token = max(0.0, catch_up - draft_seconds) / max(1, n - 1)
    else:
        step_model = StepTimeModel([1], [1.0], rate=0.0)
    limit = spec.spec_disable_utilization if spec else None
    if limit is not None and not is_calibrated:
        # The device's load is judged against the calibrated knee; a placeholder model's knee of
        # 1 token would read every step as saturated and switch speculation off for good.
        logger.warning(
            "spec_disable_utilization %.2f is not applied: it needs mode auto's calibration "
            "(mode is %s)",
            limit,
            mode,
        )
    return SpeculationPolicy(
        mode,
        spec.num_speculative_tokens if spec else DEFAULT_PREDICTION_TOKENS,
        step_model,
        make_monitor(target.device.torch, step_model) if is_calibrated else None,
        spec.spec_disable_batch_size if spec else None,
        limit,
        draft_seconds,
        catch_up_per_token,
        is_calibrated=is_calibrated,
    )
