"""The EAGLE-3 head as it trains, and its loss: training-time test (TTT), SpecForge's recipe.

`TrainableEagle3Head` is plain dense PyTorch with the PUBLISHED parameter names (fc, midlayer.
self_attn.{q,k,v,o}_proj, midlayer.mlp.{gate,up,down}_proj, the three midlayer norms, norm,
lm_head) and d2t / t2d as buffers, so its state_dict is the exported checkpoint. Its embedding is
a frozen copy of the target's, outside the state_dict: the served head shares the target's. The
forward is engine.models.eagle3.head's (see its docstring), with dense causal attention.

TTT unrolls the head `ttt_length` steps over a whole sequence at once, as it drafts when served.
Head position t pairs the target's features at t with token t + 1 (step 0: h = fc(taps_t)). Step
i feeds token t + 1 + i and, as h, the head's own pre-norm output of step i - 1 at t; its query
sits at RoPE position t + i and attends to the step-0 keys at positions <= t and to the
"diagonal" keys of steps 1..i at t (each at RoPE position t + j): exactly the KV a served head
has when it drafts its (i + 1)-th token after position t. Step i at t is scored against the
target's distribution for token t + 2 + i (its logits at position t + 1 + i over the draft
vocabulary, renormalised), by soft cross-entropy averaged over the positions that count: the
token is part of the response, inside the sequence, and the target's argmax there is in the
draft vocabulary. Total loss = sum_i decay^i * loss_i (decay 0.8). Gradients flow through the
whole unroll, as in SpecForge.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.eagle3.config import Eagle3Config
from engine.training.eagle3_data import SequenceFeatures


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device="cpu"))  # moved with the head
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _SelfAttention(nn.Module):
    """Attention over [embedding ; hidden] (2H wide) against the TTT key cache: the step-0 keys
    of every position (causal) and one diagonal key per later step."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [r, 2H] the rows of this step (positions `positions`)
        cos: torch.Tensor,  # [r, head_dim]
        sin: torch.Tensor,  # [r, head_dim]
        keys: list[torch.Tensor],  # step 0's [heads, m, head_dim], then each later step's
        values: list[torch.Tensor],  # [heads, r, head_dim] at these rows; this step's appended
        positions: torch.Tensor,  # [r] sorted head positions of the rows
    ) -> torch.Tensor:
        r, d = x.shape[0], self.head_dim
        group = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(r, self.num_heads, d)
        k = self.k_proj(x).view(r, self.num_kv_heads, d)
        v = self.v_proj(x).view(r, self.num_kv_heads, d)
        q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
        k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        # GQA: query head j reads kv head j // group, as the paged backends do.
        keys.append(k.repeat_interleave(group, dim=1).transpose(0, 1))  # [heads, r, d]
        values.append(v.repeat_interleave(group, dim=1).transpose(0, 1))
        q = q.transpose(0, 1) * d**-0.5  # [heads, r, d]
        m = keys[0].shape[1]
        scores = q @ keys[0].transpose(1, 2)  # [heads, r, m]
        causal = torch.arange(m, device=x.device)[None, :] <= positions[:, None]  # [r, m]
        scores = scores.masked_fill(~causal, float("-inf"))
        diagonal = [(q * k_j).sum(-1, keepdim=True) for k_j in keys[1:]]  # each [heads, r, 1]
        probs = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1)
        out = probs[..., :m] @ values[0]  # [heads, r, d]
        for j, v_j in enumerate(values[1:]):
            out = out + probs[..., m + j, None] * v_j
        return self.o_proj(out.transpose(0, 1).reshape(r, self.num_heads * d))


class _MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _SelfAttention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _RMSNorm(h, eps)
        self.hidden_norm = _RMSNorm(h, eps)
        self.post_attention_layernorm = _RMSNorm(h, eps)

    def forward(self, embeds, hidden, cos, sin, keys, values, positions) -> torch.Tensor:
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        y = hidden + self.self_attn(x, cos, sin, keys, values, positions)
        return y + self.mlp(self.post_attention_layernorm(y))


class TrainableEagle3Head(nn.Module):
    """A head in float32, initialised as transformers initialises Llama (linears N(0, 0.02),
    norms 1); its state_dict is the published checkpoint's tensors, d2t and t2d included."""

    d2t: torch.Tensor  # [draft_vocab] int64
    t2d: torch.Tensor  # [vocab] bool
    embedding: torch.Tensor  # [vocab, H] frozen, not exported
    rope_cos: torch.Tensor  # [max_positions, head_dim]
    rope_sin: torch.Tensor
    target_to_draft: torch.Tensor  # [vocab] int64, -1 off the draft vocabulary

    def __init__(
        self,
        cfg: Eagle3Config,
        num_aux: int,
        embedding: torch.Tensor,  # [vocab, H] the target's, frozen
        d2t: torch.Tensor,  # [draft_vocab] int64
        t2d: torch.Tensor,  # [vocab] bool
        rope_cos: torch.Tensor,  # [max_positions, head_dim]
        rope_sin: torch.Tensor,
    ) -> None:
        super().__init__()
        if cfg.norm_before_residual:
            raise ValueError("the trainer makes heads without norm_before_residual.")
        h = cfg.hidden_size
        self.fc = nn.Linear(num_aux * cfg.target_hidden_size, h, bias=False)
        self.midlayer = _MidLayer(cfg)
        self.norm = _RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        # Not in the state_dict: the served head shares the target's embedding.
        self.register_buffer("embedding", embedding.float(), persistent=False)
        self.register_buffer("rope_cos", rope_cos.float(), persistent=False)
        self.register_buffer("rope_sin", rope_sin.float(), persistent=False)
        draft_ids = d2t + torch.arange(len(d2t), device=d2t.device)
        target_to_draft = torch.full((len(t2d),), -1, dtype=torch.int64, device=d2t.device)
        target_to_draft[draft_ids] = torch.arange(len(d2t), device=d2t.device)
        self.register_buffer("target_to_draft", target_to_draft, persistent=False)


@dataclass(frozen=True)
class TTTResult:
    """One sequence's loss and, per unrolled step, its loss, hits and counted positions."""

    loss: torch.Tensor  # [] sum_i decay^i * loss_i, with its graph
    step_losses: list[float]
    step_hits: list[int]  # head argmax == target argmax
    step_counts: list[int]  # positions that count

    @property
    def step_acc(self) -> list[float | None]:
        """Top-1 accuracy per unrolled step (None where no position counts)."""
        pairs = zip(self.step_hits, self.step_counts, strict=True)
        return [hits / count if count else None for hits, count in pairs]


def _shift(x: torch.Tensor, i: int, fill: float | bool | int) -> torch.Tensor:
    """x[i:] padded with `fill` back to x's length (dim 0)."""
    if i == 0:
        return x
    pad = x.new_full((i, *x.shape[1:]), fill)
    return torch.cat((x[i:], pad))


@dataclass(frozen=True)
class TTTStep:
    """One unrolled step: the head positions it computed and its pre-norm outputs there."""

    positions: torch.Tensor  # [r] int64, sorted
    hidden: torch.Tensor  # [r, H]


def ttt_unroll(
    head: TrainableEagle3Head,
    aux: torch.Tensor,  # [m, n_aux * H_target] the target's taps at head positions 0 .. m - 1
    tokens: torch.Tensor,  # [m] the token each position feeds at step 0 (token t + 1)
    ttt_length: int,
    live: torch.Tensor | None = None,  # [r] sorted positions steps >= 1 compute (None: all)
) -> Iterator[TTTStep]:
    """Each unrolled step in turn: step i feeds token t + 1 + i (0 past the end) and the previous
    step's pre-norm output. Step 0 runs at every position (its keys are every later query's
    context); a later step at position t reads only step 0's keys and its own chain at t, so
    positions whose later steps are never scored (a prompt's, short of its end) may be left
    out of them: `live`."""
    m = len(tokens)
    if m + ttt_length > len(head.rope_cos):
        raise ValueError(f"{m} positions and {ttt_length} steps exceed the RoPE table.")
    positions = torch.arange(m, device=tokens.device)
    hidden = head.fc(aux.float())  # [m, H]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i in range(ttt_length):
        if i == 1 and live is not None:
            positions, hidden = live, hidden[live]
        embeds = F.embedding(_shift(tokens, i, 0)[positions], head.embedding)  # [r, H]
        cos, sin = head.rope_cos[positions + i], head.rope_sin[positions + i]
        hidden = head.midlayer(embeds, hidden, cos, sin, keys, values, positions)  # pre-norm
        yield TTTStep(positions, hidden)


def ttt_loss(
    head: TrainableEagle3Head,
    feats: SequenceFeatures,  # on the head's device
    lm_rows: torch.Tensor,  # [draft_vocab, H] the target's LM head rows, float32
    ttt_length: int,
    decay: float = 0.8,
) -> TTTResult:
    """The training-time-test loss of one sequence (see the module's docstring). Only what a
    counted position needs is computed: the LM heads (the head's and the target's) at the
    counted rows of each step, later steps at the positions some later step counts."""
    m = len(feats.token_ids) - 1  # head positions t = 0 .. n - 2 (each needs token t + 1)
    # Row j of these is about the target's position j + 1 (token j + 2); step i reads row t + i.
    with torch.no_grad():
        target_draft = head.target_to_draft[feats.target_ids[1:]]  # [m], -1 off the vocab
        counts = torch.cat((feats.loss_mask[2:], feats.loss_mask.new_zeros(1))) & (
            target_draft >= 0
        )  # [m]
        counted = counts.nonzero().squeeze(1)  # [c] the rows any step is scored against
        target_logits = feats.hidden[1:][counted].float() @ lm_rows.T  # [c, draft_vocab]
        target_probs = torch.softmax(target_logits, dim=-1)  # renormalised over the draft vocab
        slot = torch.full((m,), -1, dtype=torch.int64, device=counts.device)
        slot[counted] = torch.arange(len(counted), device=counts.device)  # row -> its probs
        later = torch.zeros_like(counts)
        for i in range(1, ttt_length):
            later |= _shift(counts, i, False)
        live = later.nonzero().squeeze(1)  # positions some step >= 1 scores
    total = feats.hidden.new_zeros((), dtype=torch.float32)
    losses, hits, num = [], [], []
    for i, step in enumerate(
        ttt_unroll(head, feats.aux[:m], feats.token_ids[1:], ttt_length, live)
    ):
        mask = _shift(counts, i, False)[step.positions]  # [r]
        rows = step.positions[mask] + i  # [k] the target rows these are scored against
        logits = head.lm_head(head.norm(step.hidden[mask]))  # [k, draft_vocab]
        p = target_probs[slot[rows]]  # [k, draft_vocab]
        per_position = -(p * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # [k]
        count = len(rows)
        loss = per_position.sum() / max(count, 1)
        total = total + decay**i * loss
        hit = logits.argmax(-1) == target_draft[rows]
        losses.append(float(loss.detach()))
        hits.append(int(hit.sum()))
        num.append(count)
    return TTTResult(total, losses, hits, num)
