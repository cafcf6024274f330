"""The EAGLE-3 head (SpecForge's export, which vLLM and SGLang load): one Llama decoder layer
whose attention reads 2·H inputs, drafting from the target's own residual stream. Its config is
read by engine/models/eagle3/config.py, its tensors by engine/models/eagle3/checkpoint.py.

The tapped layers are numbered as the engines number them: id j is the residual stream entering
target layer j (the output of layer j - 1; 0 is the embedding). Default (2, L // 2, L - 3).

Forward, at head position t (t pairs the target's features at t with token t + 1):
    h = fc(cat(aux_t))                 from the target, or the head's own output at t - 1
    x = cat(input_layernorm(embed(token)), hidden_norm(h))          [2H]
    r = h (hidden_norm(h) under norm_before_residual)
    y = r + o_proj(attention(x));  out = y + mlp(post_attention_layernorm(y))
    logits over the draft vocabulary = lm_head(norm(out)), scattered into the target's.
`out`, before the final norm, is what the next chained step takes as its h.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.eagle3.config import Eagle3Config
from engine.models.gguf import serving_layout
from engine.models.gguf_quantize import quantize_q6_k, quantize_q8_0
from engine.models.linears import Linear, QuantLinear, float32_linear
from engine.models.llama import MLP, Attention, ForwardContext, RMSNorm


class Eagle3Layer(nn.Module):
    """The head's decoder layer: attention over [embedding ; hidden] (2H wide), then the MLP."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 0, dtype, in_features=2 * h)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [num_tokens, 2H]
        x = residual + self.self_attn(x, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_kv(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> None:
        """Only the K/V forward would write (its attention's input, then the K/V rows)."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        self.self_attn.write_kv(x, ctx)


class Eagle3Head(nn.Module):
    """The head as the engine runs it: `forward` (paged attention over the head's KV) returns the
    pre-norm output, `compute_logits` the draft vocabulary's logits, `to_target` scatters them."""

    batch_invariant = False  # the LM head's product in the GPU's batch-invariant mode

    def __init__(
        self, head: Eagle3Config, cfg: ModelConfig, num_aux: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.config = cfg
        self.head_config = head
        h = head.hidden_size
        self.fc = Linear(
            num_aux * head.target_hidden_size, h, bias=False, device="meta", dtype=dtype
        )
        # What forward's `hidden` is per token (fc's output, or the head's own last output):
        # CUDA graphs give it a fixed input tensor of this width (engine.execution.cuda_graphs).
        self.input_hidden_size = h
        self.midlayer = Eagle3Layer(cfg, head.norm_before_residual, dtype)
        self.norm = RMSNorm(h, head.rms_norm_eps, dtype)
        self.lm_head = Linear(h, head.draft_vocab_size, bias=False, device="meta", dtype=dtype)
        self.embed_tokens: nn.Embedding | None = None  # the head's own, when it has one
        self.draft_to_target: torch.Tensor  # the buffer below
        self._shared_embed: list[nn.Module] = []  # the target's, held outside the module tree
        # draft id -> target id (arange + d2t), a buffer filled by the loader.
        self.register_buffer(
            "draft_to_target",
            torch.empty(head.draft_vocab_size, dtype=torch.int64, device="meta"),
            persistent=False,
        )

    def share_embedding(self, embed: nn.Module) -> None:
        """Embed tokens with the target's table (a head without `embed_tokens.weight`); kept
        out of the module tree so its bytes are counted once, in the target."""
        self._shared_embed = [embed]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.embed_tokens if self.embed_tokens is not None else self._shared_embed[0]
        return table(input_ids).to(self.dtype)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's tapped states [n, n_aux * H_target] -> the head's h [n, H]."""
        return self.fc(aux.to(self.dtype))

    def forward(
        self, input_ids: torch.Tensor, ctx: ForwardContext, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [n], hidden [n, H] -> the pre-norm output [n, H]. Without hidden (the
        runner's own forward, which times a chained step) h is zeros."""
        embeds = self.embed(input_ids)
        if hidden is None:
            hidden = torch.zeros_like(embeds)
        return self.midlayer(embeds, hidden, ctx)

    def write_kv(self, input_ids: torch.Tensor, ctx: ForwardContext, hidden: torch.Tensor) -> None:
        """Write the head's K/V at the tokens' positions as forward(input_ids, ctx, hidden)
        would, without the rest of the layer: about a seventh of its products per token."""
        self.midlayer.write_kv(self.embed(input_ids), hidden, ctx)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Pre-norm outputs [rows, H] -> logits over the draft vocabulary [rows, draft_vocab]."""
        if isinstance(self.lm_head, QuantLinear):
            return self.lm_head.float32_product(self.norm(out))
        return float32_linear(self.norm(out), self.lm_head.weight, self.batch_invariant)

    def quantize(self, qformat: str, int8_activations: bool = False) -> None:
        """Multiply by GGUF blocks (our CPU kernels) instead of the dense weights: every linear
        of the head, the LM head included. "q8_0": Q8_0 blocks (about half the bytes a chained
        step reads in bfloat16), float32 activations. "q6_k": Q6_K blocks (needs every input
        width a multiple of 256), with `int8_activations` multiplied by int8-quantised
        activations in integer dot products, as the target's K-quant blocks are (several rows
        cost little more than one: the extend's and a batch's rows)."""
        quantizers = {"q8_0": quantize_q8_0, "q6_k": quantize_q6_k}
        if qformat not in quantizers:
            raise ValueError(
                f"unknown head quantization {qformat!r}; specserve offers {', '.join(quantizers)}."
            )
        linears = [(n, m) for n, m in self.named_modules() if isinstance(m, Linear)]
        if qformat == "q6_k":
            odd = [n for n, m in linears if m.in_features % 256]
            if odd:
                raise ValueError(
                    f"q6_k needs input widths that are multiples of 256; {', '.join(odd)} "
                    "are not (use q8_0)."
                )
        for name, module in linears:
            quant = QuantLinear(
                module.in_features, module.out_features, module.bias is not None, self.dtype
            )
            if module.bias is not None:
                quant.bias = module.bias
            quant.set_weight([serving_layout(quantizers[qformat](module.weight))])
            quant.int8_activations = qformat == "q6_k" and int8_activations
            parent, _, child = name.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, child, quant)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def to_target(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, draft_vocab] -> [rows, vocab_size]: each at its target id, -inf elsewhere."""
        full = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
        full[:, self.draft_to_target] = draft_logits
        return full


# ------------------------------------------------------------------------------------ the files
