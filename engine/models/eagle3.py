"""EAGLE-3 draft heads in the published checkpoint format (SpecForge's export, which vLLM and
SGLang load): one Llama decoder layer whose attention reads 2·H inputs, drafting from the
target's own residual stream.

A head directory holds `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`,
`num_hidden_layers: 1`, the usual Llama fields, `vocab_size` = the target's, `draft_vocab_size`,
optionally `target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`) and
safetensors with exactly these tensors:

    fc.weight                                 [H, n_aux * H_target]
    midlayer.self_attn.{q,k,v}_proj.weight    [heads * head_dim, 2H]  (k, v: kv heads)
    midlayer.self_attn.o_proj.weight          [H, heads * head_dim]
    midlayer.mlp.{gate,up}_proj.weight        [I, H];  midlayer.mlp.down_proj.weight [H, I]
    midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight  [H]
    norm.weight [H];  lm_head.weight [draft_vocab, H]
    d2t int64 [draft_vocab]: an OFFSET, target id = draft id + d2t[draft id]
    t2d bool [vocab]: which target ids the draft vocabulary holds (not read when serving)
    embed_tokens.weight [vocab, H]: optional; without it the target's embedding is shared

The same head in vllm-project/speculators' layout (architectures `Eagle3Speculator`,
`speculators_model_type: eagle3`, the layer's fields nested in `transformer_layer_config`,
`eagle_aux_hidden_state_layer_ids` and the head's flags at the top, tensors under `layers.0.`,
`norm_before_residual` true unless it says otherwise) is read as vLLM reads it.

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

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import MLP, Attention, ForwardContext, Linear, RMSNorm

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")

# Keys other than these in config.json change the forward in ways this loader does not know; a
# head that sets one to a value other than its default is refused rather than served wrong.
_UNSUPPORTED_FLAGS = {"fc_norm": False, "mlp_bias": False, "norm_before_fc": False,
                      "norm_output": False}  # fmt: skip
# vllm-project/speculators' layout of the same head: architectures ["Eagle3Speculator"] (or
# its draft model's class), `speculators_model_type: eagle3`, the decoder layer's Llama fields
# nested in `transformer_layer_config`, the head's own fields at the top (the tapped layers as
# `eagle_aux_hidden_state_layer_ids`), tensors under `layers.0.` rather than `midlayer.`.
SPECULATORS_ARCHITECTURES = ("Eagle3Speculator", "Eagle3DraftModel")
_SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                       *_UNSUPPORTED_FLAGS)  # fmt: skip


@dataclass(frozen=True)
class Eagle3Config:
    """A head's config.json, read as vLLM and SGLang read it."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth
    attention_bias: bool = False
    norm_before_residual: bool = False
    path: Path | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], path: Path | None = None) -> Eagle3Config:
        where = f"EAGLE-3 head {path}" if path else "EAGLE-3 head"
        raw = _from_speculators(raw, where)
        archs = list(raw.get("architectures") or [])
        if not any(a in HEAD_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{where}: config.json architectures {archs} name no EAGLE-3 head "
                f"(expected {HEAD_ARCHITECTURES[0]!r})."
            )
        if int(raw.get("num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"{where}: num_hidden_layers is {raw['num_hidden_layers']}; an EAGLE-3 head "
                "has one decoder layer."
            )
        for key, default in _UNSUPPORTED_FLAGS.items():
            if bool(raw.get(key, default)) != default:
                raise ValueError(f"{where}: {key}={raw[key]!r} is not supported.")
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        vocab = int(raw["vocab_size"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            vocab_size=vocab,
            draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(int(i) for i in ids) if ids else None,
            attention_bias=bool(raw.get("attention_bias", False)),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
            path=path,
            raw=dict(raw),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Eagle3Config:
        path = Path(path)
        file = path / "config.json"
        if not file.is_file():
            raise ValueError(f"EAGLE-3 head {path}: no config.json.")
        return cls.from_dict(json.loads(file.read_text()), path)

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose input the head reads: the head's own, else the default."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        n = num_target_layers
        return (2, n // 2, n - 3)

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming the first way this head does not fit the target."""
        where = f"EAGLE-3 head {self.path or ''}".rstrip()
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"{where} reads target hidden states of size {self.target_hidden_size}; the "
                f"target {target.path.name} has hidden_size {target.hidden_size}."
            )
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"{where} has vocab_size {self.vocab_size}; the target {target.path.name} has "
                f"{target.vocab_size}: a head is trained for one target's vocabulary."
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"{where}: draft_vocab_size {self.draft_vocab_size} is not within [1, "
                f"vocab_size {self.vocab_size}]."
            )
        layers = self.aux_layers(target.num_layers)
        bad = [i for i in layers if not 0 <= i < target.num_layers]
        if not layers or bad:
            raise ValueError(
                f"{where} taps target layers {list(layers)}; the target has {target.num_layers} "
                f"layers, so each must be in [0, {target.num_layers})."
            )
        if len(set(layers)) != len(layers):
            raise ValueError(f"{where} taps target layers {list(layers)}: one is named twice.")

    def as_model_config(self, target: ModelConfig) -> ModelConfig:
        """The head as the runner sizes it: one layer of KV, the target's vocabulary (the rows
        the verifier compares), RoPE from the head's own config."""
        from transformers import LlamaConfig

        raw = {k: v for k, v in self.raw.items() if k not in ("architectures", "eagle_config")}
        hf = LlamaConfig.from_dict(raw)
        return ModelConfig(
            path=self.path or target.path,
            architecture=HEAD_ARCHITECTURES[0],
            vocab_size=target.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=int(self.raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=False,
            attention_bias=self.attention_bias,
            qk_norm=False,
            torch_dtype=str(self.raw.get("torch_dtype") or "bfloat16"),
            eos_token_ids=target.eos_token_ids,
            hf_config=hf,
        )


def _from_speculators(raw: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    """A speculators-layout config.json as the SpecForge layout says the same head (vLLM's
    reading: `norm_before_residual` defaults to true there); any other config as it is."""
    archs = list(raw.get("architectures") or [])
    if raw.get("speculators_model_type") is None and not any(
        a in SPECULATORS_ARCHITECTURES for a in archs
    ):
        return raw
    if raw.get("speculators_model_type") not in (None, "eagle3"):
        raise ValueError(
            f"{where}: speculators_model_type {raw['speculators_model_type']!r} is not an "
            "EAGLE-3 head (expected 'eagle3')."
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError(f"{where}: a speculators config needs transformer_layer_config.")
    flat = {k: v for k, v in layer.items() if k not in ("architectures", "eagle_config")}
    flat.update({k: raw[k] for k in _SPECULATORS_FIELDS if raw.get(k) is not None})
    flat.setdefault("norm_before_residual", True)
    flat["architectures"] = [HEAD_ARCHITECTURES[0]]
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        flat["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    return flat


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
        from engine.models.llama import QuantLinear, float32_linear

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
        from engine.models.gguf import quantize_q6_k, quantize_q8_0, serving_layout
        from engine.models.llama import QuantLinear

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

# Checkpoint name -> (our parameter, rows of it) for the fused projections.
_FUSED = {
    "midlayer.self_attn.q_proj": ("midlayer.self_attn.qkv_proj", 0),
    "midlayer.self_attn.k_proj": ("midlayer.self_attn.qkv_proj", 1),
    "midlayer.self_attn.v_proj": ("midlayer.self_attn.qkv_proj", 2),
    "midlayer.mlp.gate_proj": ("midlayer.mlp.gate_up_proj", 0),
    "midlayer.mlp.up_proj": ("midlayer.mlp.gate_up_proj", 1),
}
REQUIRED_KEYS = (
    "fc.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
)


def _canonical(name: str) -> str:
    """Names as SpecForge exports them; some exports prefix `model.` or call the layer
    `layers.0`."""
    name = name.removeprefix("model.")
    if name.startswith("layers.0."):
        name = "midlayer." + name.removeprefix("layers.0.")
    return name


def read_head_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of the head directory's safetensors (or
    pytorch_model.bin, as the original EAGLE releases ship)."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield _canonical(name), f.get_tensor(name)
        return
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ValueError(f"EAGLE-3 head {path}: no *.safetensors (or *.bin) weights.")
    for file in bins:
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items():
            yield _canonical(name), tensor


def load_head(
    head: Eagle3Config,
    cfg: ModelConfig,
    num_aux: int,
    dtype: torch.dtype,
    device: torch.device,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> Eagle3Head:
    """Build the head and fill it from `tensors` (checkpoint names), or the head directory's
    files. Every required tensor must be there in its published shape; the error names what is
    missing or misshapen."""
    where = f"EAGLE-3 head {head.path or ''}".rstrip()
    given = dict(tensors) if tensors is not None else dict(read_head_tensors(head.path))
    missing = [k for k in REQUIRED_KEYS if k not in given]
    if head.draft_vocab_size == head.vocab_size and "d2t" in missing:
        missing.remove("d2t")  # a full-vocabulary head needs no mapping
    if missing:
        raise ValueError(f"{where} lacks tensors {', '.join(missing)}.")
    model = Eagle3Head(head, cfg, num_aux, dtype)
    has_embed = "embed_tokens.weight" in given
    if has_embed:
        model.embed_tokens = nn.Embedding(
            head.vocab_size, head.hidden_size, device="meta", dtype=dtype
        )
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    q = head.num_heads * head.head_dim
    kv = head.num_kv_heads * head.head_dim
    rows = {
        "midlayer.self_attn.qkv_proj": [0, q, q + kv, q + 2 * kv],
        "midlayer.mlp.gate_up_proj": [0, head.intermediate_size, 2 * head.intermediate_size],
    }
    filled = dict.fromkeys(params, 0)
    for name, src in given.items():
        if name in ("d2t", "t2d"):
            continue
        module, _, kind = name.rpartition(".")
        if module in _FUSED:
            fused, shard = _FUSED[module]
            ours = f"{fused}.{kind}"
            bounds = rows[fused]
            dst = params[ours].data[bounds[shard] : bounds[shard + 1]] if ours in params else None
        else:
            ours = name
            dst = params[ours].data if ours in params else None
        if dst is None:
            raise ValueError(f"{where}: tensor {name!r} has no place in an EAGLE-3 head.")
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(
                f"{where}: {name} has shape {list(src.shape)}, expected {list(dst.shape)}."
            )
        dst.copy_(src.to(dtype))
        filled[ours] += dst.numel()
    unfilled = [n for n, p in params.items() if filled[n] != p.numel()]
    if unfilled:
        raise ValueError(f"{where}: no values for {', '.join(unfilled)}.")
    ids = torch.arange(head.draft_vocab_size, dtype=torch.int64, device="cpu")
    if "d2t" in given:
        d2t = given["d2t"]
        if tuple(d2t.shape) != (head.draft_vocab_size,) or d2t.is_floating_point():
            raise ValueError(
                f"{where}: d2t must be integer offsets of shape [{head.draft_vocab_size}], "
                f"got {d2t.dtype} {list(d2t.shape)}."
            )
        ids = ids + d2t.to(torch.int64)
    if ids.min() < 0 or ids.max() >= head.vocab_size or len(set(ids.tolist())) != len(ids):
        raise ValueError(
            f"{where}: d2t maps draft ids outside [0, {head.vocab_size}) or two onto one id."
        )
    model.draft_to_target = ids.to(device)
    model.requires_grad_(False)
    return model


def head_state(model: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names (q/k/v and gate/up split again), with d2t
    and t2d: what `save_head` writes and what vLLM's and SGLang's loaders read."""
    head = model.head_config
    q = head.num_heads * head.head_dim
    kv = head.num_kv_heads * head.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        tensor = param.detach().to("cpu").contiguous()
        if name.startswith("midlayer.self_attn.qkv_proj."):
            kind = name.rpartition(".")[2]
            parts = tensor.split([q, kv, kv])
            for proj, part in zip("qkv", parts, strict=True):
                out[f"midlayer.self_attn.{proj}_proj.{kind}"] = part.contiguous()
        elif name.startswith("midlayer.mlp.gate_up_proj."):
            gate, up = tensor.split([head.intermediate_size, head.intermediate_size])
            out["midlayer.mlp.gate_proj.weight"] = gate.contiguous()
            out["midlayer.mlp.up_proj.weight"] = up.contiguous()
        else:
            out[name] = tensor
    ids = model.draft_to_target.to("cpu")
    out["d2t"] = ids - torch.arange(len(ids), dtype=torch.int64, device="cpu")
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool, device="cpu")
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def save_head(model: Eagle3Head, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head directory: config.json and model.safetensors in the published format."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v) for k, v in head_state(model).items()
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = dict(model.head_config.raw)
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return path


def head_config_dict(
    target: ModelConfig,
    draft_vocab_size: int,
    aux_layer_ids: tuple[int, ...] | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int | None = None,
) -> dict[str, Any]:
    """config.json of a head for `target` as SpecForge writes one: the target's width, heads and
    RoPE (its scaling too: a Llama 3.1 target's llama3 frequencies), one layer, the draft
    vocabulary's size, and the tapped layers when given."""
    rope = dict(getattr(target.hf_config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta") or getattr(target.hf_config, "rope_theta", None) or 10000.0
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    scaling = scaling or dict(getattr(target.hf_config, "rope_scaling", None) or {})
    raw: dict[str, Any] = {
        "architectures": [HEAD_ARCHITECTURES[0]],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "max_position_embeddings": max_position_embeddings or target.max_position_embeddings,
        "rope_theta": float(theta),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raw["rope_scaling"] = scaling
    if aux_layer_ids is not None:
        raw["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    return raw
