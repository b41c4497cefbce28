"""``CausalLMModule``: finetune any Hugging Face causal LM with Lightning."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric
from typing_extensions import override

from gym_lightning.engine import EngineSettings, LMEngine, base_model_of
from gym_lightning.errors import raise_if_problems
from gym_lightning.generation import GenerationArgs, exact_match, generate_completions
from gym_lightning.lora import LoRAArgs, apply_lora
from gym_lightning.loss import AgreedCounts, agreed_counts_of
from gym_lightning.models.compiled import CompileArgs, compile_layers
from gym_lightning.models.experts import expert_targets, install_routed_experts
from gym_lightning.models.facts import ModelFacts, model_facts
from gym_lightning.models.fused import FusedOps, apply_fused_ops
from gym_lightning.models.loading import (
    AttnImplementation,
    DType,
    build_causal_lm,
    import_model_code,
    load_model_config,
)
from gym_lightning.models.plan import plan_of
from gym_lightning.models.presets import resolve_tokenizer_source
from gym_lightning.objectives import Objective, objective_from_value
from gym_lightning.optim import (
    DecayRule,
    HFSchedulerName,
    OptimizerName,
    SchedulerName,
    build_optimizer,
    hf_decay_names,
    hf_scheduler,
    lr_multiplier,
    resolve_warmup_steps,
    weight_decay_groups,
)
from gym_lightning.precision import fp32_master_weights
from gym_lightning.protocols import OptimizerFacts
from gym_lightning.quant.config import QuantizationArgs, check_strategy
from gym_lightning.tokenizer import load_tokenizer


class CausalLMModule(pl.LightningModule):
    """Finetune a Hugging Face causal language model.

    The model is built in ``configure_model`` so that strategies can shard it while it is created. Each training
    and validation batch goes to the ``objective`` (``gym_lightning.objectives``), which runs the model through the
    module's LM engine (``gym_lightning.engine``): supervised finetuning by default, whose loss of an optimizer step
    is the sum of target-token cross-entropies divided by the number of target tokens in the whole step, over all
    gradient-accumulation micro-batches and all data-parallel ranks (see ``gym_lightning.loss``). The non-finite
    guard, the Hugging Face export and the mid-epoch loader position are callbacks that work with any
    LightningModule: ``callbacks.NonFiniteGuard``, ``HFExport`` and ``checkpointing.ResumeLoaderPositions`` (the
    command line adds them; ``StepCheckpoint`` restores loader positions itself).

    Args:
        model: A built-in preset (``tiny-llama``, ``tiny-qwen3``), a local folder with ``config.json`` (and weights),
            or a Hugging Face Hub name.
        tokenizer: Tokenizer folder or hub name; ``None`` uses the model's own (the shipped one for presets).
        pretrained: Load the weights of a folder or hub model; False trains its shape from a random init.
        config_overrides: Attributes set on the model config before building (e.g. ``{"num_hidden_layers": 2}``).
        torch_dtype: Parameter dtype: ``auto`` (the checkpoint's), ``float32``, ``bfloat16``, ``float16``; ``None``
            keeps transformers' default. Mixed precision is the Trainer's ``precision``.
        attn_implementation: ``eager``, ``sdpa``, ``flash_attention_2``, ``flex_attention``; ``None`` lets
            transformers choose.
        gradient_checkpointing: Recompute activations in the backward pass (transformers' own checkpointing).
        trust_remote_code: Allow code from the model's repository to run. Off by default: it executes remote code.
        special_tokens: Tokens of the vocabulary that replace the tokenizer's own, ``{"eos_token": "<|im_end|>"}``
            (``eos_token``, ``pad_token``, ``bos_token``; TRL's ``--eos_token``/``--pad_token``). The CLI links
            them to the data module's; generation and the exported tokenizer use them.
        lora: LoRA settings; ``None`` finetunes all parameters.
        quantization: 4-bit NF4 base weights (QLoRA; ``quant.QuantizationArgs``), quantised as they are read;
            needs ``lora`` (the 4-bit base is frozen) and a pretrained folder or hub model with safetensors.
        lr: Peak learning rate of AdamW (> 0).
        weight_decay: AdamW weight decay, applied to matrices only (not to biases and norm weights).
        betas: AdamW betas.
        eps: AdamW epsilon.
        scheduler: ``cosine``, ``linear`` (decay to ``min_lr_ratio * lr``) or ``constant``, after warm-up.
        warmup_steps: Linear warm-up length in optimizer steps; wins over ``warmup_ratio`` when > 0.
        warmup_ratio: Warm-up length as a fraction of the Trainer's total optimizer steps, in [0, 1).
        min_lr_ratio: Final learning rate as a fraction of ``lr``, in [0, 1].
        optim: The optimizer, by its HF Trainer ``--optim`` name: ``adamw_torch_fused`` (default, as in HF 5: no
            full-size temporaries in the step; the for-loop AdamW on devices without the fused kernel),
            ``adamw_torch``, ``sgd``, ``adagrad``, ``rmsprop``, ``adafactor`` (betas/eps apply to AdamW only).
        hf_scheduler: A ``transformers.SchedulerType`` name (``linear``, ``cosine_with_min_lr``, ...): the schedule
            is ``transformers.get_scheduler``'s, the HF Trainer's numbers (warm-up ``step/warmup``, where
            ``scheduler`` warms up as ``(step+1)/(warmup+1)``); replaces ``scheduler`` and ``min_lr_ratio``.
        scheduler_kwargs: Extra arguments of the ``hf_scheduler`` (e.g. ``{"min_lr_rate": 0.1}``).
        decay_rule: Which parameters ``weight_decay`` applies to: ``ndim`` (2-D and more) or ``hf`` (the HF
            Trainer's: all but biases and LayerNorm/norm-named weights; ``optim.hf_decay_names``).
        generation: How completions are generated for ``predict`` and the exact-match metric.
        val_exact_match: Also score greedy completions of the validation prompts against their references.
        loss_chunking: Compute the LM head and the cross-entropy ``loss_chunk_tokens`` positions at a time, each
            chunk's logits recomputed in backward, so the ``[tokens, vocab]`` fp32 logits never exist whole
            (``gym_lightning.loss.chunked_summed_cross_entropy``; same loss and gradients, one more LM-head matmul
            per step). ``auto``: for vocabularies of ``loss.CHUNKED_LOSS_MIN_VOCAB`` (65,536) entries or more and
            models whose forward takes ``logits_to_keep`` (transformers' causal LMs do); ``on``; ``off``.
        loss_chunk_tokens: Positions per LM-head chunk (>= 1): 1,024 at a 151,936 vocabulary is 0.6 GB of fp32
            logits per chunk.
        mlp_tile_tokens: Run every dense MLP over at most this many token positions at a time in training, each
            tile recomputed in backward, so the ``[tokens, intermediate]`` activations exist for one tile only
            (``models.tiling``; long sequences, ALST's tiled MLP; one more MLP forward per step). ``None``: off.
        compile: The fast path: ``torch.compile`` each decoder layer's forward (``models.compiled``; one graph for
            every layer and every sequence length). ``true``, or ``models.compiled.CompileArgs`` settings
            (``{mode: max-autotune-no-cudagraphs}``); ``false``: eager (the default). HF's ``--torch_compile``.
        fused_ops: Fused RMSNorm, SwiGLU, RoPE and linear cross-entropy, each switchable
            (``models.fused.FusedOps``: ``{kernels: liger}`` for Liger-Kernel's Triton kernels, ``{swiglu: false}``
            ...). ``null``: on with ``compile`` (torch kernels, which the compiler fuses), off without; ``true``:
            all on; ``false``: off. HF's ``--use_liger_kernel`` is ``{kernels: liger}``.
        objective: What training optimises (``objectives.OBJECTIVES``): ``sft`` (the default; ``null`` is ``sft``),
            ``pt`` (continued pretraining), or an ``objectives.Objective`` with its settings (``class_path`` and
            ``init_args`` in YAML, or ``{name: ..., <settings>}``).
    """

    def __init__(
        self,
        model: str = "tiny-llama",
        tokenizer: str | None = None,
        pretrained: bool = True,
        config_overrides: dict[str, Any] | None = None,
        torch_dtype: DType | None = None,
        attn_implementation: AttnImplementation | None = None,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        special_tokens: dict[str, str] | None = None,
        lora: LoRAArgs | None = None,
        quantization: QuantizationArgs | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        scheduler: SchedulerName = "cosine",
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        min_lr_ratio: float = 0.0,
        optim: OptimizerName = "adamw_torch_fused",
        hf_scheduler: HFSchedulerName | None = None,
        scheduler_kwargs: dict[str, Any] | None = None,
        decay_rule: DecayRule = "ndim",
        generation: GenerationArgs = GenerationArgs(),  # noqa: B008 - frozen dataclass, safe as a default
        val_exact_match: bool = False,
        loss_chunking: Literal["auto", "on", "off"] = "auto",
        loss_chunk_tokens: int = 1024,
        mlp_tile_tokens: int | None = None,
        compile: bool | CompileArgs = False,
        fused_ops: bool | FusedOps | None = None,
        objective: Objective | str | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        lora = LoRAArgs.from_value(lora)  # a dict where the settings come as plain data (YAML, a checkpoint)
        quantization = QuantizationArgs.from_value(quantization)
        compile_args = CompileArgs.from_value(compile)
        fused = _fused_ops_of(fused_ops, compiled=compile_args is not None)
        training_objective = objective_from_value(objective)  # hparams keep the value as given (plain data)
        _validate({**locals(), "compile": compile_args, "fused_ops": fused, "objective": training_objective})
        self.save_hyperparameters(ignore=["training_objective"])
        self.model_source = model
        self.tokenizer_source = resolve_tokenizer_source(model, tokenizer)
        self.lora = lora
        self.quantization = quantization
        self.generation = generation
        self.compile_args = compile_args
        self.fused_ops = fused
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self.objective = training_objective
        self.engine = LMEngine(
            EngineSettings(loss_chunking, loss_chunk_tokens, mlp_tile_tokens, fused), agree_counts=self._agree_counts
        )
        self.val_loss = MeanMetric()
        self.val_exact_match = MeanMetric()

    # ----------------------------------------------------------------------------------------------- building
    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        hp = self.hparams
        trainer = self._attached_trainer()
        if self.quantization is not None and trainer is not None:
            check_strategy(trainer.strategy)
        # LoRA adapters are drawn from the CPU generator's state before the build, whatever the build drew (a random
        # initialisation under ZeRO-3's zero.Init, nothing on the meta device): every strategy starts from the same
        # adapters, as one process does (docs/benchmarks-history.md, "LoRA adapters drawn before the build").
        with torch.random.fork_rng(devices=[]) if self.lora is not None else nullcontext():
            model = build_causal_lm(
                self.model_source,
                pretrained=hp.pretrained,
                config_overrides=hp.config_overrides,
                dtype=hp.torch_dtype,
                attn_implementation=hp.attn_implementation,
                trust_remote_code=hp.trust_remote_code,
                plan=plan_of(trainer.strategy if trainer is not None else None),
                quantization=self.quantization,
            )
        if self.fused_ops is not None:  # before tiling: fused ops leave a module whose forward is replaced alone
            apply_fused_ops(model, self.fused_ops)
        self.engine.tile(model)
        if hp.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        model.train()  # from_pretrained returns a model in eval mode; Lightning switches modes per stage from here
        if self.lora is not None:
            # On a meta-device build (sharded loading) the adapters get their storage and values here, the base
            # weights once the strategy has sharded it.
            # Mixture-of-experts weights are adapted (``lora.target_parameters``) and held in NF4 (QLoRA) as fused 3-D
            # tensors: peft sizes their adapters from the 16-bit shapes, and gym's forward runs the routed experts.
            model = apply_lora(model, self.lora, expert_targets(model))
            install_routed_experts(model, self.lora.dropout)
        if self.compile_args is not None:  # last: the layers' LoRA and fused forwards are traced on the first call
            compile_layers(model, self.compile_args)
        if trainer is not None:  # without a Trainer there is no precision to follow
            fp32_master_weights(model, trainer.precision_plugin)
        self.model = model
        self.objective.configure_model(self)

    def _attached_trainer(self) -> pl.Trainer | None:
        """The Trainer, or ``None`` when ``configure_model`` is called without one (no strategy, no precision)."""
        try:
            return self.trainer
        except RuntimeError:
            return None

    @override
    def setup(self, stage: str) -> None:
        if self.model is None:
            # Before configure_model, outside any construction context the strategy opens there (models.loading).
            import_model_code(self._model_config(), self.hparams.trust_remote_code)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(
                self.tokenizer_source, self.hparams.trust_remote_code, self.hparams.get("special_tokens")
            )

    # ----------------------------------------------------------------------------------------------- training
    @override
    def on_fit_start(self) -> None:
        self.objective.on_fit_start(self)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        return self.objective.training_step(self, batch)

    def _agree_counts(self, local: list[int]) -> AgreedCounts:
        """The call counts every rank makes (``engine.LMEngine``'s ``agree_counts``): the strategy decides how
        (``protocols.AgreesCallCounts``; ZeRO-3 gathers weights on each call, so every rank must make as many)."""
        trainer = self._attached_trainer()
        return agreed_counts_of(trainer.strategy if trainer is not None else None, local)

    def _base_model(self) -> torch.nn.Module:
        """The transformers model (inside a peft wrapper when LoRA is on)."""
        return base_model_of(self.model)

    # ----------------------------------------------------------------------------------------------- evaluation
    @override
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss, weight = self.objective.validation_loss(self, batch)
        self.val_loss.update(loss, weight=weight)
        if self.hparams.val_exact_match and "references" in batch:
            predictions = self._generate(batch)
            self.val_exact_match.update(exact_match(predictions, batch["references"]).to(self.device))

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.log_dict(
            {"val/loss": loss, **({"val/ppl": torch.exp(loss)} if self.objective.perplexity else {})}, prog_bar=True
        )
        self.val_loss.reset()
        if self.hparams.val_exact_match and self.val_exact_match.update_count > 0:
            self.log("val/exact_match", self.val_exact_match.compute(), prog_bar=True)
            self.val_exact_match.reset()

    @override
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> list[dict[str, str]]:
        completions = self._generate(batch)
        return [{"prompt": p, "completion": c} for p, c in zip(batch["prompts"], completions, strict=True)]

    def _generate(self, batch: dict[str, Any]) -> list[str]:
        return generate_completions(
            self.model,
            self.tokenizer,
            batch["prompt_input_ids"],
            batch["prompt_attention_mask"],
            self.generation,
            synced_gpus=self.trainer.world_size > 1,
        )

    # ----------------------------------------------------------------------------------------------- optimisation
    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay_names = hf_decay_names(self.model) if hp.decay_rule == "hf" else None
        groups = weight_decay_groups(self.model.named_parameters(), hp.weight_decay, decay_names)
        optimizer = build_optimizer(hp.optim, groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = resolve_warmup_steps(hp.warmup_steps, hp.warmup_ratio, total)
        if hp.hf_scheduler is not None:
            steps = {"warmup_steps": warmup, "total_steps": total}
            schedule = hf_scheduler(hp.hf_scheduler, optimizer, **steps, kwargs=hp.scheduler_kwargs)
        else:
            multiplier = partial(
                lr_multiplier, name=hp.scheduler, warmup_steps=warmup, total_steps=total, min_lr_ratio=hp.min_lr_ratio
            )
            schedule = LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def optimizer_facts(self) -> OptimizerFacts:
        """The optimizer settings a strategy may need (``protocols.ProvidesOptimizerFacts``; DeepSpeed's "auto")."""
        hp = self.hparams
        return OptimizerFacts(
            lr=hp.lr,
            betas=(float(hp.betas[0]), float(hp.betas[1])),
            eps=hp.eps,
            weight_decay=hp.weight_decay,
            warmup_steps=hp.warmup_steps,
            warmup_ratio=hp.warmup_ratio,
        )

    def model_facts(self) -> ModelFacts:
        """The model's width and layer size (``protocols.ProvidesModelFacts``; DeepSpeed's buffer sizes)."""
        return model_facts(self._model_config(), self.model_source)

    def _model_config(self) -> Any:
        # ZeRO-3 asks before configure_model builds the model (inside zero.Init): read the model config then.
        if self.model is not None and hasattr(self.model, "config"):
            return self.model.config
        hp = self.hparams
        return load_model_config(self.model_source, hp.config_overrides, hp.trust_remote_code)


def _fused_ops_of(value: bool | FusedOps | dict[str, Any] | None, compiled: bool) -> FusedOps | None:
    """The fused ops a module runs: ``None`` follows ``compile`` (the fast path fuses by default, eager does not)."""
    if value is False or (value is None and not compiled):
        return None
    return FusedOps() if value is None or value is True else FusedOps.from_value(value)


def _validate(args: dict[str, Any]) -> None:
    """Raise one ValueError listing every invalid constructor argument."""
    problems = []
    if args["lr"] <= 0:
        problems.append(f"lr must be > 0, got {args['lr']}")
    if args["weight_decay"] < 0:
        problems.append(f"weight_decay must be >= 0, got {args['weight_decay']}")
    if not all(0.0 <= b < 1.0 for b in args["betas"]) or len(args["betas"]) != 2:
        problems.append(f"betas must be two numbers in [0, 1), got {args['betas']}")
    if args["warmup_steps"] < 0:
        problems.append(f"warmup_steps must be >= 0, got {args['warmup_steps']}")
    if not 0.0 <= args["warmup_ratio"] < 1.0:
        problems.append(f"warmup_ratio must be in [0, 1), got {args['warmup_ratio']}")
    if not 0.0 <= args["min_lr_ratio"] <= 1.0:
        problems.append(f"min_lr_ratio must be in [0, 1], got {args['min_lr_ratio']}")
    if not isinstance(args["loss_chunk_tokens"], int) or args["loss_chunk_tokens"] < 1:
        problems.append(f"loss_chunk_tokens must be an integer >= 1, got {args['loss_chunk_tokens']!r}")
    tile = args["mlp_tile_tokens"]
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        problems.append(f"mlp_tile_tokens must be an integer >= 1 or null (no tiling), got {tile!r}")
    if args["compile"] is not None:
        problems += args["compile"].problems()
        if tile is not None:
            problems.append(
                "compile and mlp_tile_tokens do not compose: the tile count changes with the batch and each count "
                "would compile the layer again; drop one of them"
            )
    if args["fused_ops"] is not None:
        problems += args["fused_ops"].problems()
    if args["lora"] is not None:
        problems += args["lora"].problems()
    if args["quantization"] is not None:
        problems += args["quantization"].problems()
        if args["lora"] is None:
            problems.append(
                "quantization (a 4-bit base) needs lora: the NF4 weights are frozen and cannot be finetuned; "
                "set model.lora (QLoRA), or drop model.quantization for a full finetune"
            )
    problems += args["generation"].problems()
    problems += args["objective"].problems()
    raise_if_problems("Invalid CausalLMModule settings", problems)


__all__ = ["CausalLMModule", "resolve_tokenizer_source"]
