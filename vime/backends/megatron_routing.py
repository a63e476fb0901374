"""R3, rollout routing replay, on the trainer side: force the experts the rollout engine chose.

With ``--use-rollout-routing-replay`` each sample carries ``rollout_routed_experts``: for every token
the engine ran through the model (all but the last), the top-k expert ids of each MoE layer. Every
Megatron forward over the sample then routes each token to exactly those experts; the weights given to
them are still computed by the trainer's router from its own logits (megatron-core's
``RouterReplay``, ``TransformerConfig.moe_enable_routing_replay``), so the router keeps its gradient.

megatron-core keeps every ``RouterReplay`` in one process-wide list and replays a list of tensors
across all of them; vime builds more than one model (actor, reference) and drives each model's
routers itself, so :func:`detach_from_global_replay` takes them out of that list.

Positions without a record (each row's last token, padding) get experts ``0..k-1``: their outputs
never reach a trained log-prob (causal attention; the last token's logits are dropped; padding is masked).
"""

from __future__ import annotations

import numpy as np
import torch

from vime.backends.megatron_args import ModelArgs


def moe_routers(model) -> list:
    """The MoE routers of ``model`` (a GPTModel) in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def detach_from_global_replay(model) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    mine = {id(r.router_replay) for r in moe_routers(model) if r.router_replay is not None}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
    ]


def force_routes(model, per_layer: list[torch.Tensor] | None) -> None:
    """Route the next forwards of ``model`` by ``per_layer[i]`` ([tokens, topk] in the order MoE layer i's
    router sees them: sequence-major, [S, B] flattened) or, with ``None``, freely (a router set to record
    its choices, megatron-core's RECORD action, keeps recording).

    The routes stay set until the next call, so that activation recomputation during the backward pass of
    the same micro-batch replays them too.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = moe_routers(model)
    if per_layer is not None and len(per_layer) != len(routers):
        raise ValueError(f"routes for {len(per_layer)} MoE layers, the model has {len(routers)}")
    for i, router in enumerate(routers):
        replay = router.router_replay
        if replay is None:
            if per_layer is None:
                continue
            raise RuntimeError("the model was built without routing replay (MoeOptions.routing_replay)")
        if per_layer is None:
            if replay.router_replay_action != RouterReplayAction.RECORD:
                replay.clear_indices()
                replay.clear_router_replay_action()
        else:
            replay.clear_indices()  # also empties the backward list, which set_target_indices appends to
            replay.set_target_indices(per_layer[i])
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def sample_routes(routed_experts, num_tokens: int, args: ModelArgs) -> torch.Tensor:
    """A sample's ``rollout_routed_experts`` as a long tensor [num_tokens - 1, MoE layers, topk].

    vLLM reports one row per decoder layer (a dense layer's row is unused); rows of the MoE layers only
    are accepted as well.
    """
    routes = torch.as_tensor(np.asarray(routed_experts)).long()
    moe_layers = len(args.moe_layers)
    if routes.dim() != 3 or routes.shape[0] != num_tokens - 1 or routes.shape[2] != args.moe_router_topk:
        raise ValueError(
            f"routed experts of shape {tuple(routes.shape)}; expected [len(tokens) - 1 = "
            f"{num_tokens - 1}, layers, topk = {args.moe_router_topk}]"
        )
    if routes.shape[1] == args.num_layers and moe_layers != args.num_layers:
        routes = routes[:, list(args.moe_layers)]
    elif routes.shape[1] != moe_layers:
        raise ValueError(
            f"routed experts for {routes.shape[1]} layers; the model has {args.num_layers} layers, "
            f"{moe_layers} of them MoE"
        )
    if routes.numel() and (int(routes.min()) < 0 or int(routes.max()) >= args.num_experts):
        raise ValueError(f"routed expert ids outside [0, {args.num_experts})")
    return routes


def _filler(args: ModelArgs, shape: tuple[int, ...]) -> torch.Tensor:
    """Distinct experts 0..k-1 for positions without a record (their outputs are never used)."""
    return torch.arange(args.moe_router_topk).expand(*shape, args.moe_router_topk).clone()


def padded_layout(routes: list[torch.Tensor], length: int, args: ModelArgs) -> torch.Tensor:
    """[MoE layers, length, rows, topk] for right-padded rows of ``length`` tokens (row b's record covers
    its first ``len(routes[b])`` positions)."""
    out = _filler(args, (len(args.moe_layers), length, len(routes)))
    for row, r in enumerate(routes):
        n = min(r.shape[0], length)
        out[:, :n, row] = r[:n].transpose(0, 1)
    return out


def packed_layout(routes: list[torch.Tensor], lengths: list[int], total: int, args: ModelArgs) -> torch.Tensor:
    """[MoE layers, total, 1, topk] for rows of ``lengths`` tokens packed back to back (``total`` includes
    any padding after the last row)."""
    out = _filler(args, (len(args.moe_layers), total, 1))
    start = 0
    for r, n in zip(routes, lengths):
        k = min(r.shape[0], n)
        out[:, start : start + k, 0] = r[:k].transpose(0, 1)
        start += n
    return out


def per_layer(
    layout: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1, sequence_parallel: bool = False, device=None
) -> list[torch.Tensor]:
    """A [layers, S, B, topk] layout as each router sees it: [S * B, topk] (this rank's sequence slice
    under sequence parallelism)."""
    if sequence_parallel and tp_size > 1:
        layout = layout.chunk(tp_size, dim=1)[tp_rank]
    return [layer.reshape(-1, layer.shape[-1]).to(device) for layer in layout]
