"""Model shapes: what a decoder's parameters are, from its config alone (no weights, nothing built).

The memory planner (``gym_lightning.planner``) and the model facts a strategy sizes its buffers with
(``models.facts``) need shapes only: hidden size, MLP width, layer count, attention heads, key/value heads,
head dimension, vocabulary, whether the LM head shares the embedding, and the small tensors Qwen adds (QK-norm in
Qwen3, q/k/v biases in Qwen2). Parameter counts are computed from these shapes for a Llama-style decoder
(``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` / ``MistralForCausalLM``, and
the mixtures of experts ``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM``: total and active counts) and checked in
``tests/planner/test_estimate.py`` against the counts the model cards publish and the models transformers builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gym_lightning.errors import GymUserError

LoraTargets = Literal["all-linear", "attention-qv"]


@dataclass(frozen=True)
class TensorGroup:
    """``count`` tensors of ``numel`` elements each; ``trainable`` under the finetuning mode it was built for."""

    name: str
    numel: int
    count: int
    trainable: bool


@dataclass(frozen=True)
class ModelShape:
    """Shapes of a Llama-style decoder-only transformer (RMSNorm, rotary attention with GQA, SwiGLU MLP).

    Args:
        name: Label shown in reports.
        hidden_size: Residual stream width ``h``.
        intermediate_size: SwiGLU width ``I`` (gate/up project ``h -> I``, down ``I -> h``).
        num_layers: Decoder layers ``L``.
        num_heads: Query heads ``a``.
        num_kv_heads: Key/value heads (``a`` without GQA).
        head_dim: Per-head width (``h / a`` for Llama; Qwen3 sets it explicitly).
        vocab_size: Embedding rows ``V``.
        tied_embeddings: The LM head reuses the embedding matrix.
        qk_norm: Per-head RMSNorm on queries and keys (Qwen3).
        attention_bias: Biases on the q/k/v projections (Qwen2 / Qwen2.5).
        num_experts: Routed experts per layer ``E`` of a mixture of experts whose every layer is sparse (Qwen3-MoE,
            Mixtral); 0 for a dense model. Each layer's MLP is then a router (``h -> E``) and ``E`` SwiGLU experts
            of width ``moe_intermediate_size``, stored as transformers 5 does: two 3-D tensors per layer
            (``gate_up_proj`` ``E x 2I x h``, ``down_proj`` ``E x h x I``).
        experts_per_token: Experts each token is routed to, ``k`` (0 for a dense model).
        moe_intermediate_size: Width ``I`` of one expert's SwiGLU.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qk_norm: bool = False
    attention_bias: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in_features, out_features)`` of each ``nn.Linear`` in one decoder layer (a mixture of experts has only
        the attention's: its router and experts are plain parameters, :meth:`expert_numels`)."""
        h, q, kv, inter = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.is_moe:
            return attention
        return {**attention, "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}

    def expert_numels(self) -> dict[str, int]:
        """Elements of one layer's router and expert tensors (empty for a dense model)."""
        if not self.is_moe:
            return {}
        h, e, inter = self.hidden_size, self.num_experts, self.moe_intermediate_size
        return {"router": e * h, "experts.gate_up_proj": e * 2 * inter * h, "experts.down_proj": e * h * inter}

    def active_params(self) -> int:
        """Parameters one token uses: all but the ``E - k`` experts it is not routed to (the "A3B" of a model card)."""
        experts = sum(n for name, n in self.expert_numels().items() if name.startswith("experts.")) * self.num_layers
        return self.num_params() - (experts * (self.num_experts - self.experts_per_token) // max(self.num_experts, 1))

    def largest_tensor(self) -> int:
        """Elements of the model's largest parameter tensor (what an export or a gather holds whole)."""
        linear = max(i * o for i, o in self.linear_shapes().values())
        return max(self.embedding_params(), linear, *self.expert_numels().values())

    def layer_params(self) -> int:
        """Parameters of one decoder layer (the unit FSDP shards and ZeRO-3 gathers)."""
        return sum(g.numel * g.count for g in self.tensor_groups() if g.name.startswith("layer.")) // self.num_layers

    def num_params(self) -> int:
        """Parameters of the base model (a tied LM head counted once), without LoRA adapters."""
        return sum(g.numel * g.count for g in self.tensor_groups())

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def tensor_groups(self, lora_r: int = 0, lora_targets: LoraTargets = "all-linear") -> list[TensorGroup]:
        """Every parameter tensor, grouped by shape. ``lora_r > 0`` freezes the base and adds rank-``r`` adapters
        ``A`` (``r x in``) and ``B`` (``out x r``) on the targeted linear layers (peft's LoRA layout)."""
        full = lora_r == 0
        L, h = self.num_layers, self.hidden_size
        groups = [TensorGroup("embed_tokens", self.vocab_size * h, 1, full), TensorGroup("norm", h, 1, full)]
        if not self.tied_embeddings:
            groups.append(TensorGroup("lm_head", self.vocab_size * h, 1, full))
        for name, (fan_in, fan_out) in self.linear_shapes().items():
            groups.append(TensorGroup(f"layer.{name}", fan_in * fan_out, L, full))
        for name, numel in self.expert_numels().items():
            groups.append(TensorGroup(f"layer.{name}", numel, L, full))
        groups.append(TensorGroup("layer.norms", h, 2 * L, full))
        if self.qk_norm:
            groups.append(TensorGroup("layer.qk_norm", self.head_dim, 2 * L, full))
        if self.attention_bias:
            groups += [TensorGroup("layer.q_bias", self.q_width, L, full)]
            groups += [TensorGroup("layer.kv_bias", self.kv_width, 2 * L, full)]
        if not full:
            targets = lora_target_names(lora_targets)
            for name, (fan_in, fan_out) in self.linear_shapes().items():
                if name in targets:
                    groups.append(TensorGroup(f"lora.{name}.A", lora_r * fan_in, L, True))
                    groups.append(TensorGroup(f"lora.{name}.B", fan_out * lora_r, L, True))
        return groups


def lora_target_names(targets: LoraTargets) -> tuple[str, ...]:
    """Linear layers adapted by LoRA: ``all-linear`` (QLoRA paper's choice, peft's ``"all-linear"``) or
    ``attention-qv`` (peft's default for Llama/Qwen: ``q_proj``, ``v_proj``)."""
    if targets == "attention-qv":
        return ("q_proj", "v_proj")
    return ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def shape_from_config(config: dict[str, Any], name: str) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dict of a Llama/Mistral/Qwen2/Qwen3 model."""
    model_type = str(config.get("model_type", ""))
    missing = [
        key
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if key not in config
    ]
    if missing:
        raise GymUserError(
            f"config of {name!r} lacks {', '.join(missing)}; the planner needs a decoder config "
            f"(model_type one of {', '.join(_ARCHITECTURES)})."
        )
    if model_type not in _ARCHITECTURES:
        raise GymUserError(
            f"model_type {model_type!r} of {name!r} is not supported: the planner's formulas are for Llama-style "
            f"decoders (model_type one of {', '.join(_ARCHITECTURES)})."
        )
    heads = int(config["num_attention_heads"])
    experts, per_token, expert_width = _moe_fields(config, name)
    return ModelShape(
        name=name,
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        vocab_size=int(config["vocab_size"]),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        num_experts=experts,
        experts_per_token=per_token,
        moe_intermediate_size=expert_width,
    )


def _moe_fields(config: dict[str, Any], name: str) -> tuple[int, int, int]:
    """``(E, k, I)`` of a Qwen3-MoE / Mixtral config (``(0, 0, 0)`` for a dense one). The shapes assume every layer
    is sparse, as in every published Qwen3-MoE and Mixtral; a config with dense layers among them is refused."""
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if not experts:
        return 0, 0, 0
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise GymUserError(
            f"config of {name!r} mixes dense and sparse layers (mlp_only_layers / decoder_sparse_step); the planner's "
            "mixture-of-experts shapes assume every layer is sparse, as in the published Qwen3-MoE and Mixtral models: "
            "plan with mlp_only_layers=[] and decoder_sparse_step=1 (an upper bound: its dense layers count as sparse)."
        )
    width = config.get("moe_intermediate_size") or config["intermediate_size"]  # Mixtral: experts are the MLP width
    return experts, int(config["num_experts_per_tok"]), int(width)
