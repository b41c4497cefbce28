"""Activations, logits and the long-sequence transients of one rank's training step (pure, no torch).

What a Hugging Face Llama / Qwen decoder layer saves for backward, counted from the code (Korthikanti et al. 2022,
Sec. 4.1, redone for these layers: :func:`activation_bytes_per_layer`); the LM head and loss, chunked or not
(:func:`logits_bytes`); DeepSpeed Ulysses / ALST sequence parallelism (Jacobs et al. 2023, arXiv 2309.14509;
Bekman et al. 2025, arXiv 2506.13996), which splits each sequence over sp ranks so that every per-token term counts
one rank's ``ceil(s/sp)`` tokens (``spec.local_tokens``), with its all-to-all buffers
(:func:`attention_exchange_bytes`); and a tiled MLP, which keeps its ``[tokens, I]`` intermediates for at most T
tokens at a time (:func:`mlp_tile_bytes`). docs/planner.md, "Activations" and "Long sequences", derives each term.
"""

from __future__ import annotations

from gym_lightning.errors import GymUserError
from gym_lightning.models.shapes import ModelShape
from gym_lightning.planner.experts import expert_adapter_activation_bytes
from gym_lightning.planner.spec import RunSpec, local_tokens

# The module's ``loss_chunking="auto"`` threshold (gym_lightning.loss.CHUNKED_LOSS_MIN_VOCAB; not imported: the
# planner stays free of torch). tests/planner/test_estimate.py checks that the two agree.
CHUNKED_LOSS_MIN_VOCAB = 65_536


def _is_int(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def sequence_parallel_problems(shape: ModelShape | None, spec: RunSpec) -> list[str]:
    """Every reason ``spec`` cannot run sequence parallelism / a tiled MLP on ``shape`` (empty when it can; the
    head checks are skipped when ``shape`` is None). The runtime refuses the same settings
    (``strategies/sequence.world_problems`` and ``model_problems``): the ranks must form
    whole groups of sp, Ulysses hands each rank ``heads/sp`` query heads and ``kv/sp`` key/value heads (or one
    replicated kv head when kv divides sp; DeepSpeed's ``UlyssesSPAttentionHF`` has the same rule), and eager
    attention would materialise the ``s x s`` scores of the whole sequence. A length that sp does not divide is
    padded (``spec.local_seq_length``), not refused."""
    sp, problems = spec.sequence_parallel_size, []
    if not _is_int(spec.mlp_tile_tokens, 0):
        problems.append(f"mlp_tile_tokens must be an integer >= 0 (0 = MLP not tiled), got {spec.mlp_tile_tokens!r}")
    if not _is_int(sp, 1):
        return [f"sequence_parallel_size must be an integer >= 1, got {sp!r}", *problems]
    if sp == 1:
        return problems
    world = spec.world_size if _is_int(spec.gpus_per_node, 1) and _is_int(spec.nodes, 1) else 0
    if world and world % sp:
        problems.append(
            f"sequence_parallel_size {sp} does not divide the {world} GPUs into whole groups: use a divisor of {world}"
        )
    if shape is not None:
        problems += _head_problems(shape, sp)
    if spec.attention == "eager":
        problems.append(
            "attention eager stores the s x s scores, which sequence parallelism refuses: use attention sdpa"
        )
    return problems


def _head_problems(shape: ModelShape, sp: int) -> list[str]:
    problems = []
    if shape.num_heads % sp:
        problems.append(
            f"{shape.name} has {shape.num_heads} attention heads, not divisible by sequence_parallel_size {sp}: use a "
            f"divisor of {shape.num_heads}"
        )
    kv = shape.num_kv_heads
    if kv % sp and sp % kv:
        problems.append(
            f"{shape.name} has {kv} key/value heads, neither a multiple nor a divisor of sequence_parallel_size "
            f"{sp}: use an sp that divides {kv} or that {kv} divides"
        )
    return problems


def check_setup(shape: ModelShape, spec: RunSpec) -> None:
    """Raise one :class:`GymUserError` (a ``ValueError``) listing every :func:`sequence_parallel_problems`."""
    problems = sequence_parallel_problems(shape, spec)
    if problems:
        raise GymUserError("Invalid planner settings: " + "; ".join(problems) + ".")


def sp_kv_width(shape: ModelShape, spec: RunSpec) -> int:
    """Key/value width per token as the attention sees it under sequence parallelism: ``max(kv heads, sp) x
    head_dim``. Ulysses gives each rank ``heads/sp`` heads of the whole sequence; with fewer kv heads than sp
    ranks (GQA) the kv heads are first replicated to sp heads, one per rank (as DeepSpeed's ``UlyssesSPAttentionHF``
    does: ``repeat_interleave(sp // kv)`` in ``runtime/sequence_parallel/ulysses_sp.py``). At sp = 1 this is the
    model's kv width."""
    return max(shape.num_kv_heads, spec.sequence_parallel_size) * shape.head_dim


def saved_kv_width(shape: ModelShape, spec: RunSpec) -> int:
    """Width per token of each of k and v as the attention saves them for backward. Both transformers' sdpa (sp = 1;
    the planner assumes no padding mask, which would make it repeat them) and gym_lightning's exchange
    (``strategies/sequence.causal_attention``) run grouped-query attention inside sdpa (``enable_gqa``), so k and
    v are saved at the kv width; under sequence parallelism that is the width after the exchange replicated fewer
    kv heads than ranks (:func:`sp_kv_width`)."""
    return sp_kv_width(shape, spec)


def mlp_tiles(shape: ModelShape, spec: RunSpec, micro_batch: int) -> int:
    """Tiles each dense MLP runs in for ``micro_batch`` (``CausalLMModule(mlp_tile_tokens=T)``, T > 0):
    ``ceil(b s/sp / T)``, as ``models.tiling.num_mlp_tiles`` counts them. 1 means untiled: without T, for a mixture
    of experts (``models.tiling.dense_mlps`` leaves its expert block alone), and when the rank's tokens fit one tile
    (the module then runs the plain MLP, which saves its intermediates as usual)."""
    if spec.mlp_tile_tokens <= 0 or shape.is_moe:
        return 1
    return -(-local_tokens(spec, micro_batch) // spec.mlp_tile_tokens)


def _mlp_bytes_per_token(shape: ModelShape, a_b: int) -> int:
    """What the MLP saves for backward per token: the SwiGLU's gate, SiLU output, up and product (``4 a_b I``), or a
    mixture of experts' routed inputs, outputs and SwiGLU terms and its router (see activation_bytes_per_layer)."""
    if not shape.is_moe:
        return 4 * a_b * shape.intermediate_size
    expert = 2 * a_b * shape.hidden_size + 4 * a_b * shape.moe_intermediate_size
    return shape.experts_per_token * expert + (a_b + 4) * shape.num_experts


def activation_bytes_per_layer(shape: ModelShape, spec: RunSpec, micro_batch: int) -> float:
    """Bytes one decoder layer saves for backward (Korthikanti et al. 2022, Sec. 4.1, redone for Llama-style layers).

    The paper's ``sbh(34 + 5as/h)`` is for a GPT layer (LayerNorm, GELU MLP of width 4h, dropout, attention scores
    materialised). A Hugging Face Llama/Qwen layer in 16-bit activations instead saves, per token:
    two RMSNorms, each ``4h`` (the fp32 upcast) + ``2h`` (normalised, for the weight's gradient) + ``2h`` (output,
    the next linear's input); the rotated q, k, v (``2(q + 2kv)``); the attention output and o_proj's input
    (``4q``); the SwiGLU's gate, SiLU output, up and product (``8I``); no dropout masks (dropout is 0). SDPA
    (flash / memory-efficient) keeps only an fp32 log-sum-exp per head (``4a``) instead of the ``5as`` scores term;
    eager attention stores the fp32 softmax and its 16-bit copy (``6as``). In fp32 every 16-bit term doubles.

    A mixture of experts (transformers 5's expert loop, ``Qwen3MoeExperts.forward``) saves, per token, the router's
    logits and fp32 softmax (``(a_b + 4)E``) and, for each of its ``k`` experts, the gathered input and the weighted
    output (``2 a_b h``) and the expert's SwiGLU terms (``4 a_b I``): the SwiGLU's ``4 a_b I`` becomes
    ``k(2 a_b h + 4 a_b I) + (a_b + 4)E``. Derived from the code, not yet checked against a measured MoE peak.

    Per rank under sequence parallelism: the same terms for the rank's ``s/sp`` tokens (:func:`local_tokens`). The
    attention's saved q, output and log-sum-exp are ``s x heads/sp``, the same element count as ``s/sp x heads``;
    k and v are saved at the kv width, or at ``sp`` heads where the exchange replicated fewer (:func:`saved_kv_width`).
    A tiled MLP saves no ``[tokens, I]`` intermediates (each tile is recomputed in backward; :func:`mlp_tile_bytes`
    is its transient).
    """
    h, q, kv = shape.hidden_size, shape.q_width, saved_kv_width(shape, spec)
    a_b = 2 if spec.precision == "bf16-mixed" else 4
    mlp = 0 if mlp_tiles(shape, spec, micro_batch) > 1 else _mlp_bytes_per_token(shape, a_b)
    mlp += expert_adapter_activation_bytes(shape, spec.lora_r, spec.lora_target_parameters, a_b)
    per_token = 2 * (4 * h + 2 * a_b * h) + a_b * (q + 2 * kv) + 2 * a_b * q + mlp + 4 * shape.num_heads
    if spec.attention == "eager":  # refused under sp > 1 (sequence_parallel_problems): s is the whole sequence
        per_token += (4 + a_b) * shape.num_heads * spec.seq_length
    return float(per_token * local_tokens(spec, micro_batch))


def attention_exchange_bytes(shape: ModelShape, spec: RunSpec, micro_batch: int) -> float:
    """The Ulysses all-to-all buffers of one layer's attention (0 without sequence parallelism): q, k, v go out
    as ``s/sp x heads`` and come back as ``s x heads/sp`` (the same elements), the output the other way; send and
    receive buffers of all four, ``2 a_b (2q + 2kv') x local tokens`` with ``kv'`` = :func:`sp_kv_width`. One layer
    exchanges at a time (in forward and in the backward recompute), so the term is counted once, not per layer.

    Read from ``strategies/sequence.ulysses_attention``: while the output is exchanged back, a rank holds beside
    what is saved the local rotated q, k, v (its arguments, ``q + 2kv'``), the whole-sequence k, v before their
    repeat (``2kv'``) and the output's send, receive and reordered copies (``3q``): ``4q + 4kv'`` elements a token,
    the same figure."""
    if spec.sequence_parallel_size == 1:
        return 0.0
    a_b = 2 if spec.precision == "bf16-mixed" else 4
    elements = 2 * shape.q_width + 2 * sp_kv_width(shape, spec)
    return float(2 * a_b * elements * local_tokens(spec, micro_batch))


def mlp_tile_bytes(shape: ModelShape, spec: RunSpec, micro_batch: int) -> float:
    """A tiled MLP's transient (0 untiled): one tile's SwiGLU intermediates, ``4 a_b I x ceil(t / tiles)`` (at most
    ``4 a_b I T``; ``tensor_split`` makes the tiles this even). Each tile runs under non-reentrant activation
    checkpointing, so these exist for one tile of one layer at a time, in forward and again when the tile is
    recomputed in backward (as ALST's ``TiledMLP`` in DeepSpeed's ``runtime/sequence_parallel/ulysses_sp.py``,
    whose tiles are about ``h`` tokens: ``ceil(s / h)`` shards)."""
    tiles = mlp_tiles(shape, spec, micro_batch)
    if tiles == 1:
        return 0.0
    a_b = 2 if spec.precision == "bf16-mixed" else 4
    return float(4 * a_b * shape.intermediate_size * -(-local_tokens(spec, micro_batch) // tiles))


def activation_bytes(shape: ModelShape, spec: RunSpec, micro_batch: int) -> float:
    """Activations of the whole stack. With activation checkpointing (full recomputation per decoder layer, the
    paper's ``2sbhL``) only each layer's input is kept, plus one layer's activations while it is recomputed. Plus
    the one-layer-at-a-time transients: the attention exchange under sequence parallelism and one MLP tile."""
    a_b = 2 if spec.precision == "bf16-mixed" else 4
    tokens = local_tokens(spec, micro_batch)
    one_layer = activation_bytes_per_layer(shape, spec, micro_batch)
    transient = attention_exchange_bytes(shape, spec, micro_batch) + mlp_tile_bytes(shape, spec, micro_batch)
    if spec.activation_checkpointing:
        return shape.num_layers * a_b * shape.hidden_size * tokens + one_layer + transient
    return shape.num_layers * one_layer + (4 + a_b) * shape.hidden_size * tokens + transient  # + the final RMSNorm


def loss_chunked(shape: ModelShape, spec: RunSpec) -> bool:
    """Whether the module computes the LM head and the loss in chunks (``CausalLMModule.loss_chunking``)."""
    if spec.loss_chunking == "auto":
        return shape.vocab_size >= CHUNKED_LOSS_MIN_VOCAB
    return spec.loss_chunking == "on"


def logits_bytes(shape: ModelShape, spec: RunSpec, micro_batch: int) -> float:
    """The LM head's output and the loss: logits in the compute dtype, their fp32 upcast (the loss computes in fp32)
    and the fp32 log-softmax cross-entropy keeps for backward, ``(a_b + 4 + 4)`` bytes per position and vocabulary
    entry. Unchunked that is the whole ``[s b, V]`` (often the single largest activation: V = 128k-152k for Llama 3
    / Qwen). Chunked (``gym_lightning.loss``), each chunk of ``loss_chunk_tokens`` positions runs under activation
    checkpointing, so only one chunk's logits exist at a time, in forward and again when recomputed in backward."""
    a_b = 2 if spec.precision == "bf16-mixed" else 4
    positions = local_tokens(spec, micro_batch)  # under sequence parallelism each rank's loss covers its s/sp tokens
    if loss_chunked(shape, spec):
        positions = min(positions, spec.loss_chunk_tokens)
    return float(positions * shape.vocab_size * (a_b + 8))
