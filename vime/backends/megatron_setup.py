"""The Megatron backend's checks and choices before it builds a model: the rank's pipeline stage and
context split, the parallel layouts megatron-core cannot train, the batching (thd or padded) and the role
overrides it honours. Each refusal names the flag to change.
"""

from __future__ import annotations

from vime.backends.megatron_spec import MegatronBackendSpec
from vime.config.base import ConfigError
from vime.config.roles import FLAG as ROLES_FLAG, TORCH_ROLE_KEYS, RoleConfig


def pipeline_stage(megatron: MegatronBackendSpec):
    """This rank's pipeline stage (None without pipeline parallelism)."""
    from vime.backends.megatron_pipeline import Pipeline, check_stage_layers

    if megatron.parallel.pipeline == 1:
        return None
    check_stage_layers(megatron.model.num_layers, megatron.parallel)
    return Pipeline()


def context_split(megatron: MegatronBackendSpec):
    """This rank's part of the context-parallel group (None without context parallelism)."""
    from vime.backends.megatron_context import ContextSplit

    parallel = megatron.parallel
    if parallel.context == 1:
        return None
    if megatron.packing == "thd":
        raise ValueError(
            f"--context-parallel-size {parallel.context}: packed (thd) sequences are not supported; "
            "use --megatron-packing padded (or auto)"
        )
    return ContextSplit.from_megatron()


def check_moe_tensor_parallelism(megatron: MegatronBackendSpec) -> None:
    """megatron-core trains MoE layers under tensor parallelism only with sequence parallelism: say so
    before the model is built."""
    if not megatron.model.is_moe or megatron.parallel.tensor == 1:
        return
    if not megatron.parallel.sequence_parallel:
        raise ValueError(
            "--sequence-parallel: megatron-core trains MoE layers with --tensor-model-parallel-size "
            f"{megatron.parallel.tensor} only under sequence parallelism"
        )


def _refuse_spread(what: str, sizes: dict[str, int]) -> None:
    """``what`` (a model part) is built for the parallel sizes ``sizes`` (flag -> size) at 1 only yet: a larger one
    is refused, naming its flag."""
    for flag, size in sizes.items():
        if size > 1:
            raise ValueError(
                f"{flag} {size}: {what} trains with 1 only yet; spread the model with --pipeline-model-parallel-size "
                "and --expert-model-parallel-size"
            )


def check_mla_parallelism(megatron: MegatronBackendSpec) -> None:
    """Multi-latent attention is built for tensor and context parallelism 1 only yet: at tensor parallelism 2,
    megatron-core's own MLA layers under vime's gradient reduction (vime.backends.megatron_gradients) gave wrong
    gradients (docs/megatron.md, "Multi-latent attention"), and context parallelism was not tried."""
    if megatron.model.multi_latent_attention:
        parallel = megatron.parallel
        _refuse_spread(
            f"multi-latent attention ({megatron.model.family})",
            {"--tensor-model-parallel-size": parallel.tensor, "--context-parallel-size": parallel.context},
        )


def check_linear_attention(megatron: MegatronBackendSpec) -> None:
    """Gated delta-net layers (Qwen3-Next, Qwen3.5) train with tensor and context parallelism 1, on padded
    micro-batches: megatron-core's ``GatedDeltaNet`` refuses packed sequences and context parallelism, and splitting
    its fused input projection over tensor-parallel ranks (each kind of row split on its own) is not built here yet."""
    model, parallel = megatron.model, megatron.parallel
    if not model.is_hybrid:
        return
    _refuse_spread(
        f"{model.family}'s gated delta-net layers",
        {"--tensor-model-parallel-size": parallel.tensor, "--context-parallel-size": parallel.context},
    )
    if megatron.packing == "thd":
        raise ValueError(
            f"--megatron-packing thd: {model.family}'s gated delta-net layers take padded micro-batches only "
            "(megatron-core's GatedDeltaNet refuses packed sequences); use 'padded' or 'auto'"
        )


def check_query_key_norms_over_heads(megatron: MegatronBackendSpec) -> None:
    """MiniMax-M2's query and key norms span all heads: under tensor parallelism each rank holds some heads, and the
    norms' statistics would need a sum over the ranks, which is not built."""
    if megatron.model.qk_norm_over_heads:
        _refuse_spread(
            f"{megatron.model.family}'s query and key norms over all heads",
            {"--tensor-model-parallel-size": megatron.parallel.tensor},
        )


def check_expert_parallelism(megatron: MegatronBackendSpec) -> None:
    """Expert (EP) and expert tensor (ETP) parallelism: experts spread over ranks, or split inside."""
    ep, etp, model = megatron.parallel.expert, megatron.parallel.expert_tensor_size, megatron.model
    if not model.is_moe:
        # How a dense model's absent experts would be split is moot (the reference's dense scripts pass
        # --expert-tensor-parallel-size 1 under --tensor-model-parallel-size 2); spreading them is not.
        if ep > 1:
            raise ValueError(f"--expert-model-parallel-size {ep}: {model.family} has no experts")
        return
    if model.num_experts % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} must divide the {model.num_experts} experts")
    if model.moe_ffn_hidden_size % etp:
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} must divide the experts' hidden size "
            f"{model.moe_ffn_hidden_size} (--moe-ffn-hidden-size)"
        )
    if megatron.ckpt_format != "torch_dist":
        raise ValueError("--ckpt-format torch cannot hold experts spread over expert-parallel ranks; use torch_dist")


def packing_mode(requested: str, te: bool) -> str:
    if requested == "thd" and not te:
        raise ValueError(
            "--megatron-packing thd needs Transformer Engine on CUDA (varlen attention); use 'padded' or 'auto'"
        )
    if requested == "auto":
        return "thd" if te else "padded"
    return requested


def check_roles(roles: RoleConfig) -> None:
    """The role overrides this backend honours are the torch backend's; the others are refused (naming
    the YAML field) rather than ignored."""
    for name, role in roles.roles.items():
        for key in role.values:
            if key not in TORCH_ROLE_KEYS[name]:
                raise ConfigError(
                    ROLES_FLAG,
                    f"{roles.source or '<yaml>'}: {role.field(key)}: the Megatron "
                    f"backend does not support this override for the {name}; it "
                    f"honours {', '.join(TORCH_ROLE_KEYS[name])}",
                )
