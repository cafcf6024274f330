"""A cached step-time fit on probation: the first served steps confirm it or show it was timed
under load.

A calibration taken while another job held the machine predicts every step too slow, and from
the cache it would mislead every later start on that machine. So a fit that is in the cache
(loaded from it, or measured now and written to it) starts unconfirmed. Every served
decode-shaped step (each query token a scored row: decode rows and drafts, no prompt chunk, the
same steps that drive the drafting correction in costs.py) gives the ratio of its forward's
seconds to what the fit as cached predicts for it. The median over NUM_CHECK_STEPS such steps
judges the fit:
- below 1 / FIT_MARGIN (the fit over-predicts by more than the margin): it was timed under load.
  It is rescaled by that median in place (the whole curve, context and row costs included: a
  load slows every shape alike to first order, and the knee stays where it was measured), so the
  policy's next decision uses it, and the cache file is removed (if it still holds this fit) so
  the next start calibrates again. No forward is timed again while serving: that would stall
  every running request, and the steps just served already measured the machine.
- above FIT_MARGIN: the machine is busier now than when it was calibrated. The fit is kept and
  the file left alone (a busy moment must not overwrite a quiet fit); the next window of steps
  judges again, so a fit timed under an even heavier load is still caught once the load passes.
- otherwise: confirmed, and kept.
After a verdict the online refinement (StepTimeModel.observe) alone follows the device.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

from engine.policy.step_time import StepTimeModel

logger = logging.getLogger(__name__)

# Served decode-shaped steps per judgement (their median ratio to the fit decides).
NUM_CHECK_STEPS = 16
# The fit stands while the served steps' median is within this factor of its prediction.
FIT_MARGIN = 1.25


class CachedFit(StepTimeModel):
    """A step-time model whose fit is in the calibration cache at `path`: "unconfirmed" until the
    served steps it observes judge it "confirmed" or "replaced" (rescaled, file removed).

    `text` is what the file held for this fit: only that is removed, not a fit another start has
    written since. `origin` names where the fit came from, for the log.
    """

    def __init__(self, fit: StepTimeModel, path: Path, text: str, origin: str) -> None:
        super().__init__(
            fit.grid, fit.values, fit.context_coef, fit.row_coef, fit.knee_threshold, fit.rate
        )
        self.path = path
        self.origin = origin
        self.state = "unconfirmed"
        self._text = text
        self._fit = StepTimeModel.from_dict(fit.to_dict())  # as cached: what steps are held to
        self._ratios: list[float] = []
        self._is_busy_logged = False

    def observe(
        self, n: int, context: int, seconds: float, rows: int = 1, off_graph: bool = False
    ) -> None:
        if self.state == "unconfirmed" and n == rows and seconds > 0 and not off_graph:
            predicted = self._fit.predict(n, context, rows)
            if predicted > 0:
                self._ratios.append(seconds / predicted)
            if len(self._ratios) >= NUM_CHECK_STEPS:
                self._judge(statistics.median(self._ratios))
                self._ratios.clear()
        super().observe(n, context, seconds, rows, off_graph)

    def _judge(self, ratio: float) -> None:
        served_t1, cached_t1 = ratio * self._fit.predict(1) * 1e3, self._fit.predict(1) * 1e3
        if ratio < 1.0 / FIT_MARGIN:
            self.state = "replaced"
            self.rescale([v * ratio for v in self._fit.values])
            self.context_coef = self._fit.context_coef * ratio
            self.row_coef = self._fit.row_coef * ratio
            removed = self._remove()
            logger.warning(
                "calibration: the %s fit at %s was taken under load: the median of %d served "
                "decode steps is %.2fx its prediction (t(1) = %.1f ms in the fit, %.1f ms "
                "served; margin %.2fx). Rescaled to the served steps for this run; %s",
                self.origin,
                self.path,
                NUM_CHECK_STEPS,
                ratio,
                cached_t1,
                served_t1,
                1.0 / FIT_MARGIN,
                "removed from the cache, the next start calibrates again"
                if removed
                else "the cache file was already replaced or gone",
            )
        elif ratio > FIT_MARGIN:
            if not self._is_busy_logged:
                self._is_busy_logged = True
                logger.info(
                    "calibration: served decode steps take %.2fx the %s fit at %s (t(1) = %.1f "
                    "ms in the fit, %.1f ms served): the machine is busier now than when it was "
                    "calibrated; the fit is kept and judged again every %d decode steps",
                    ratio,
                    self.origin,
                    self.path,
                    cached_t1,
                    served_t1,
                    NUM_CHECK_STEPS,
                )
        else:
            self.state = "confirmed"
            logger.info(
                "calibration: the %s fit at %s is confirmed: the median of %d served decode "
                "steps is %.2fx its prediction (margin %.2fx)",
                self.origin,
                self.path,
                NUM_CHECK_STEPS,
                ratio,
                FIT_MARGIN,
            )

    def _remove(self) -> bool:
        """Remove the cache file if it still holds this fit; whether it did."""
        try:
            if self.path.read_text() != self._text:
                return False
            self.path.unlink()
            return True
        except OSError:
            return False
