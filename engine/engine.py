"""`LLMEngine`: add requests, abort them, and step. One step goes one way: schedule, propose,
run (the target forward and the verify), update, observe (see `step`).

A user request with n > 1 fans out into n sequences that share the prompt (and, through the
prefix cache, its KV blocks); its `RequestOutput` gathers their completions.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import replace

from engine.build import build_engine
from engine.config import EngineConfig
from engine.core.chunks import attention_reads
from engine.core.counters import PolicyStats, SpecStats
from engine.core.drafts import Draft
from engine.core.emitted import StepTokens
from engine.core.request import Request, RequestStatus
from engine.core.schedule import SchedulerOutput
from engine.core.stats import StepStats, VerifyResult
from engine.drafters.speculator import shadow_result
from engine.execution.step_work import (
    Launched,
    build_batch,
    carry_indices,
    device_work,
    logprobs_width,
)
from engine.outputs import RequestOutput
from engine.requests.admission import compile_grammar, encode_prompt, resolve_max_tokens
from engine.requests.group import RequestGroup, new_group
from engine.requests.stop_conditions import append_tokens
from engine.sampling_params import SamplingParams
from engine.structured.state import GrammarState
from engine.telemetry.serving_metrics import EngineMetrics
from engine.telemetry.step_trace import StepTrace
from engine.text.detokenizer import IncrementalDetokenizer

_SEED_MODULUS = 2**64


class LLMEngine:
    """The continuous-batching engine over one target model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts = build_engine(config)  # each phase logs its time (engine/runtime/startup.py)
        self.model_config = parts.model_config
        self.eos_token_ids = parts.model_config.eos_token_ids
        self.tokenizer = parts.tokenizer
        self.runner, self.draft_runner = parts.runner, parts.draft_runner
        self.max_model_len = parts.max_model_len
        self.block_manager = parts.block_manager
        self.speculator, self.policy = parts.speculator, parts.policy
        self.scheduler = parts.scheduler
        self.grammars = parts.grammars
        self.verifier = parts.verifier
        # Cumulative speculation counters and policy decisions, counted from each StepStats.
        # Every draft position from the start, so its series exist before the first acceptance.
        self.spec_stats = SpecStats(accepted_per_pos=[0] * self.speculator.num_tokens)
        self.policy_stats = PolicyStats()
        self._groups: dict[str, RequestGroup] = {}
        # Seeds for requests that bring none: reproducible from the engine's own seed.
        self._seeds = random.Random(config.seed)
        self.metrics = EngineMetrics()
        # Overlapped steps, where the config asks for them and no drafter reads the target's
        # hidden states of every step; the step on the device, not yet read back.
        self.overlap = config.overlap_scheduling and not self.speculator.reads_target_states
        self._inflight: Launched | None = None
        self.step_trace = StepTrace.from_env()  # off unless SPECSERVE_STEP_TRACE names a file

    @property
    def quantization(self) -> str:
        """The target's weight format: "none" (dense) or "gguf (Q4_K + Q6_K)"."""
        return self.runner.quantization

    # ----------------------------------------------------------------------------- requests

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids for a prompt given as text or as ids; validates ids against the vocab."""
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prediction: str | Sequence[int] | None = None,
    ) -> None:
        """Validate and queue a request. Raises ValueError for input the engine cannot serve.

        `prediction` (OpenAI Predicted Outputs) is the client's guess of the output, text or
        token ids: a draft source that speculation verifies like any other."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use.")
        token_ids = self.encode_prompt(prompt)
        params.validate_for_vocab(self.model_config.vocab_size)
        max_tokens = resolve_max_tokens(self.max_model_len, len(token_ids), params)
        predicted = tuple(self.encode_prompt(prediction)) if prediction else ()
        grammar = compile_grammar(self.grammars, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = []
        for i in range(params.n):
            seq_params = params
            if params.seed is not None and i > 0:
                seq_params = replace(params, seed=(params.seed + i) % _SEED_MODULUS)
            request = Request(
                f"{request_id}#{i}",
                token_ids,
                seq_params,
                max_tokens,
                arrival,
                sampling_seed=self._seeds.getrandbits(63),
            )
            request.prediction_token_ids = predicted
            if grammar is not None:
                request.grammar = GrammarState(grammar, self.model_config.vocab_size)
            if self.tokenizer is not None:
                request.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, seq_params)
            requests.append(request)
        prompt_text = prompt if isinstance(prompt, str) else None
        self._groups[request_id] = new_group(request_id, prompt_text, token_ids, requests)
        for request in requests:
            self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. Returns False if it is unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for request in group.requests:
            if not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                self._free(request)
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.metrics.record_finished(request, status.value, time.monotonic())
        self.scheduler.finish(request, status)

    def _free(self, request: Request) -> None:
        """Forget a finished request's drafting state and acceptance estimates."""
        self.speculator.free(request)
        self.policy.forget(request.request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a step still on the device (read back by the next step)."""
        return bool(self._groups) or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ----------------------------------------------------------------------------- operator

    @property
    def speculation_mode(self) -> str:
        return self.policy.mode

    def set_speculation_mode(self, mode: str) -> None:
        """off / always / auto from the next step on (ValueError: unknown, or auto uncalibrated)."""
        self.policy.set_mode(mode)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no request holds; returns how many blocks were dropped."""
        num_cached = self.block_manager.num_cached_blocks
        self.block_manager.reset_prefix_cache()
        return num_cached - self.block_manager.num_cached_blocks

    # ----------------------------------------------------------------------------- the step

    def step(self) -> list[RequestOutput]:
        """One step, in one direction: schedule (each request's tokens, and its draft tokens from
        the speculator's offers), propose the drafts, launch the target and the verify, then read
        the results back, update the requests, and let everyone who learns or counts observe
        the step's StepStats. Returns the outputs that changed.

        Overlapped (`overlap_scheduling`), a step that drafts nothing and has no grammar or
        penalty rows is left running on the device: the next call schedules and launches the
        step after it (a decoding request's input token is carried from the device, `Carry`)
        and only then reads it back, so the host's work runs while the device computes. A step
        some request would draft in (`Speculator.is_due`) reads the one in flight first."""
        start = time.perf_counter()
        outputs: list[RequestOutput] = []
        running = self.scheduler.running
        inflight, mode = self._inflight, self.policy.mode
        if inflight is not None and self.speculator.is_due(running, mode):
            outputs, inflight = self._complete(inflight), None
            start = time.perf_counter()
        offers = self.speculator.offer(running, mode)
        schedule = self.scheduler.schedule(offers)
        if schedule.is_empty:
            return outputs + (self._complete(inflight) if inflight is not None else [])
        self.speculator.after_schedule(schedule.decisions, offers)
        self._record_scheduled(schedule)
        proposing = time.perf_counter()
        drafts = self.speculator.propose(schedule)
        draft_seconds = time.perf_counter() - proposing
        launched = self._launch(schedule, drafts, inflight, mode, draft_seconds)
        launched.host_seconds = time.perf_counter() - start - draft_seconds
        if inflight is not None:
            outputs += self._complete(inflight)
        if launched.overlapped:
            self._inflight = launched
            return outputs
        return outputs + self._complete(launched)

    def _record_scheduled(self, schedule: SchedulerOutput) -> None:
        """Queue times of sequences scheduled for the first time; a user request's prompt
        tokens count once, with the first of its sequences."""
        now = 0.0
        for s in schedule.scheduled:
            request = s.request
            if request.first_scheduled_time is not None:
                continue
            now = now or time.monotonic()
            group = self._groups[request.request_id.rpartition("#")[0]]
            is_first = all(r.first_scheduled_time is None for r in group.requests)
            self.metrics.record_scheduled(request, now, is_first)

    def _overlaps(
        self, drafts: dict[str, Draft], items: list[tuple[Request, Draft | None]]
    ) -> bool:
        """Whether a step may stay in flight while the next is scheduled: it verifies nothing,
        and no row's sampling reads what the host does not have yet (a grammar's state, the
        history penalties count)."""
        if not self.overlap or drafts:
            return False
        return all(r.grammar is None and not r.params.has_penalties for r, _ in items)

    def _launch(
        self,
        schedule: SchedulerOutput,
        drafts: dict[str, Draft],
        inflight: Launched | None,
        mode: str,
        draft_seconds: float,
    ) -> Launched:
        """Queue the step's target forward and its sampling on the device (`device_work`). An
        overlapped step samples into device tensors and queues one copy of them to the host;
        the others verify (reading their tokens back) within the work."""
        chunks, items, carried = build_batch(schedule, drafts, self.block_manager)
        overlapped = self._overlaps(drafts, items)
        device = self.runner.device
        rows = self.verifier.rows(items, device.torch)
        carry = carry_indices(schedule, chunks, carried, inflight, device)
        work = device_work(
            self.runner, self.verifier, chunks, items, rows, carry, inflight, overlapped
        )
        result = device.launch(work)
        if overlapped:  # the scheduler counts what the device is computing as done
            for s, chunk in zip(schedule.scheduled, chunks, strict=True):
                s.request.num_computed_tokens = chunk.start + s.num_new_tokens
            for request, _ in items:
                request.num_in_flight += 1
        return Launched(
            schedule,
            chunks,
            drafts,
            items,
            logprobs_width(items, self.model_config.vocab_size),
            result,
            overlapped,
            mode,
            draft_seconds,
            self.speculator.skipped,
        )

    def _complete(self, launched: Launched) -> list[RequestOutput]:
        """Read a launched step back (waiting for its device work, and no later step's), update
        its requests, and let everyone observe its StepStats."""
        if self._inflight is launched:
            self._inflight = None
        device = self.runner.device
        out = launched.result.result()
        device.wait(out.end)  # every mark of the step (the draft model's too) has passed
        forward_seconds = device.elapsed(out.start, out.end)
        reading = time.perf_counter()
        schedule, chunks = launched.schedule, launched.chunks
        num_generated = self.metrics.num_generation_tokens
        results = launched.results(out)
        if not launched.overlapped:
            # A head drafting from the target's hidden states reads this step's now (the extend).
            self.speculator.after_step(schedule, chunks, results)
        verifies, finished, touched = self._update(launched, results)
        host_seconds = launched.host_seconds + time.perf_counter() - reading
        stats = StepStats(
            decisions=schedule.decisions,
            verifies=tuple(verifies),
            num_tokens=sum(len(c.token_ids) for c in chunks),
            num_rows=sum(c.num_logits for c in chunks),
            context=sum(attention_reads(c.start, len(c.token_ids)) for c in chunks),
            forward_seconds=forward_seconds,
            draft_seconds=launched.draft_seconds,
            # The rest of the step (scheduling, policy, bookkeeping) is overhead the policy
            # weighs; overlapped, only what the device did not cover.
            overhead_seconds=max(0.0, host_seconds - forward_seconds)
            if launched.overlapped
            else host_seconds,
            draft_timing=self.speculator.take_draft_timing(),
            mode=launched.mode,
            num_generated=self.metrics.num_generation_tokens - num_generated,
            skipped=launched.skipped,
            overlapped=launched.overlapped,
            off_graph=out.off_graph,
        )
        if self.step_trace.is_on:  # with what the policy priced the step, before it learns
            model = self.policy.step_model
            predicted = model.predict(stats.num_tokens, stats.context, stats.num_rows)
            self.step_trace.write(
                stats, len(schedule.scheduled), predicted, self.policy.costs.correction
            )
        self._observe(stats, {s.request.request_id: s.request for s in schedule.scheduled})
        for request in finished:  # freed once the policy has seen their last step
            self._free(request)
        return [group.refresh() for group in touched]

    def _update(
        self, launched: Launched, results: list[StepTokens]
    ) -> tuple[list[VerifyResult], list[Request], list[RequestGroup]]:
        """Append each request's tokens, roll its KV back past rejected drafts, finish it on a
        stop condition. Returns the step's verify results, the requests it finished and the
        groups it changed. A request the step computed for may have been aborted (its results
        are dropped) or preempted (its tokens are kept, its KV is not) since it was launched,
        or scheduled again (its KV count stays the later step's)."""
        schedule, chunks, drafts = launched.schedule, launched.chunks, launched.drafts
        verifies: list[VerifyResult] = []
        finished: list[Request] = []
        touched: dict[str, RequestGroup] = {}
        step_results = iter(results)
        for s, chunk in zip(schedule.scheduled, chunks, strict=True):
            request = s.request
            running = request.status is RequestStatus.RUNNING
            if not chunk.num_logits:  # a prompt chunk short of the end
                if running:
                    num_computed = max(request.num_computed_tokens, chunk.start + s.num_new_tokens)
                    self.scheduler.update(request, num_computed)
                continue
            result = next(step_results)
            if launched.overlapped:
                request.num_in_flight -= 1
            if request.is_finished:  # aborted while the step ran
                continue
            num_old = request.num_output_tokens
            status, num_dropped = append_tokens(
                request, result.token_ids, result.logprobs, self.eos_token_ids, self.max_model_len
            )
            self.metrics.record_tokens(
                request, request.num_output_tokens - num_old, time.monotonic()
            )
            draft = drafts.get(request.request_id)
            if draft is not None:
                num_cut = min(num_dropped, result.num_accepted)
                verifies.append(
                    VerifyResult(
                        request.request_id,
                        draft.source,
                        result.num_draft_tokens,
                        result.num_accepted,
                        num_cut,
                    )
                )
            elif (shadow := shadow_result(s, result.token_ids[0])) is not None:
                verifies.append(shadow)
            if running:
                # KV stays valid for the known tokens and the accepted drafts; rejected slots
                # roll back (and so do accepted ones a stop condition cut off).
                # A later step already in flight holds a larger count: it stays.
                num_computed = min(
                    chunk.start + s.num_new_tokens + result.num_accepted, request.num_tokens - 1
                )
                self.scheduler.update(request, max(request.num_computed_tokens, num_computed))
            if status is not None:
                self._finish(request, status)
                finished.append(request)
            group_id = request.request_id.rpartition("#")[0]
            touched[group_id] = self._groups[group_id]
        for group_id, group in touched.items():
            if all(r.is_finished for r in group.requests):
                del self._groups[group_id]
        return verifies, finished, list(touched.values())

    def _observe(self, stats: StepStats, requests: dict[str, Request]) -> None:
        """Everyone who learns from or counts a step reads the same StepStats."""
        self.policy.observe(stats)
        self.spec_stats.observe(stats)
        self.policy_stats.observe(stats)
        self.metrics.observe_step(stats)
        for v in stats.verifies:
            if not v.is_shadow:
                requests[v.request_id].spec_stats.record(
                    v.num_draft_tokens, v.num_accepted, v.source, v.num_cut
                )
