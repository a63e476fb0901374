"""MoE training with the Megatron backend and R3 (rollout routing replay): the recorded experts are forced
in the Megatron forward, the rollout side's parser of vLLM's ``routed_experts``, and one RL step."""

import base64
import io
import random

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from test_megatron_backend import (  # noqa: E402
    assert_same_metrics,
    make_samples as backend_samples,
    trainer_spec,
)
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests import megatron_shim  # noqa: E402
from vime.backends import (  # noqa: E402
    megatron_forward as mf,
    megatron_model as mm,
    megatron_routing as mr,
    megatron_weights as mw,
)
from vime.backends.megatron_args import model_args_from_hf  # noqa: E402
from vime.backends.megatron_convert import hf_to_mcore, read_hf_state_dict  # noqa: E402
from vime.rollout import routing  # noqa: E402
from vime.sample import Sample  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_moe_hf_model(
        str(tmp_path_factory.mktemp("qwen3_moe")), with_tokenizer=True, **megatron_shim.MOE_VARIANTS["qwen3_moe"]
    )


@pytest.fixture(scope="module")
def args(model_dir):
    return model_args_from_hf(AutoConfig.from_pretrained(model_dir))


def _gpt(model_dir, args):
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False, moe=mm.MoeOptions(routing_replay=True))
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(model_dir), args), args)
    return gpt.eval()


def _batch():
    ids = torch.tensor(
        [[1, 2, 3, 4, 5, 11, 6, 7, 8, 9], [3, 4, 5, 11, 6, 10, 2, 0, 0, 0], [7, 7, 1, 0, 0, 0, 0, 0, 0, 0]]
    )
    lengths = [10, 7, 3]
    return ids, (torch.arange(10) < torch.tensor(lengths).unsqueeze(1)).long(), lengths


def _free_routes(gpt, lm, ids, mask, lengths):
    """The experts the routers choose freely, per row [len - 1, MoE layers, topk] (megatron's RECORD action)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    routers = mr.moe_routers(gpt)
    mr.force_routes(gpt, None)
    for r in routers:
        r.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask).logits
    # recorded [S * B, k] in the router's order (sequence-major) -> [B, S, layers, k]
    recorded = torch.stack(
        [r.router_replay.get_recorded_indices().view(ids.shape[1], ids.shape[0], -1) for r in routers], dim=2
    ).transpose(0, 1)
    mr.force_routes(gpt, None)
    return logits, [recorded[row, : n - 1] for row, n in enumerate(lengths)]


def _hf_forced(model_dir, ids, mask, routes, lengths):
    """HF's model with every router made to pick ``routes`` (weights: softmax over the chosen logits, as
    Qwen3-MoE's renormalised top-k): the manual computation the Megatron replay must equal."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch, length = ids.shape
    for layer_index, layer in enumerate(hf.model.layers):
        forced = torch.zeros(batch, length, 2, dtype=torch.long)
        forced[..., 1] = 1  # positions without a record: any two experts (never compared)
        for row, n in enumerate(lengths):
            forced[row, : n - 1] = routes[row][:, layer_index]
        gate, flat = layer.mlp.gate, forced.reshape(-1, 2)

        def forward(hidden_states, gate=gate, forced=flat):
            logits = torch.nn.functional.linear(hidden_states.reshape(-1, gate.hidden_dim), gate.weight)
            weights = torch.softmax(logits.gather(1, forced), dim=-1)
            return logits, weights, forced

        gate.forward = forward
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


def _compared(lengths):
    """Positions whose logits training uses: each row's all but last token."""
    mask = torch.zeros(len(lengths), 10, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, : n - 1] = True
    return mask


def test_replaying_the_free_routes_changes_nothing(model_dir, args):
    gpt = _gpt(model_dir, args)
    lm = mf.MegatronLM(gpt, args.vocab_size, model_args=args)
    ids, mask, lengths = _batch()
    free, routes = _free_routes(gpt, lm, ids, mask, lengths)
    with torch.no_grad():
        replayed = lm(input_ids=ids, attention_mask=mask, routes=routes).logits
    keep = _compared(lengths)
    assert torch.equal(replayed[keep], free[keep])
    # ... and they are HF's free choices too
    torch.testing.assert_close(
        _hf_forced(model_dir, ids, mask, routes, lengths)[keep], free[keep], rtol=1e-4, atol=1e-4
    )


def test_forced_routes_are_followed_and_match_a_manual_computation(model_dir, args):
    gpt = _gpt(model_dir, args)
    lm = mf.MegatronLM(gpt, args.vocab_size, model_args=args)
    ids, mask, lengths = _batch()
    free, free_routes = _free_routes(gpt, lm, ids, mask, lengths)
    # every token to the two experts the router did NOT choose
    everyone = torch.arange(args.num_experts)
    forced = [
        torch.stack([torch.stack([everyone[~torch.isin(everyone, chosen)] for chosen in token]) for token in row])
        for row in free_routes
    ]
    assert not any((f.unsqueeze(-1) == r.unsqueeze(-2)).any() for f, r in zip(forced, free_routes))
    lm.train()
    logits = lm(input_ids=ids, attention_mask=mask, routes=forced).logits
    keep = _compared(lengths)
    assert not torch.allclose(logits[keep], free[keep], atol=1e-3)
    torch.testing.assert_close(
        logits[keep], _hf_forced(model_dir, ids, mask, forced, lengths)[keep], rtol=1e-4, atol=1e-4
    )
    # the router still learns: its weights for the forced experts get gradients
    logits[keep].logsumexp(-1).sum().backward()
    for router in mr.moe_routers(gpt):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # free routing again once no routes are given
    with torch.no_grad():
        again = lm.eval()(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again[keep], free[keep])


def test_layouts_and_sample_routes():
    import tempfile

    folder = megatron_shim.tiny_moe_hf_model(tempfile.mkdtemp(), **megatron_shim.MOE_VARIANTS["qwen2_moe"])
    args = model_args_from_hf(AutoConfig.from_pretrained(folder))  # layer 0 MoE, layer 1 dense
    all_layers = np.random.default_rng(0).integers(0, 4, (5, 2, 2)).astype(np.uint8)  # as vLLM reports
    routes = mr.sample_routes(all_layers, 6, args)
    assert routes.shape == (5, 1, 2) and torch.equal(routes[:, 0], torch.as_tensor(all_layers[:, 0]).long())
    assert torch.equal(mr.sample_routes(all_layers[:, :1], 6, args), routes)  # MoE rows only: accepted too
    with pytest.raises(ValueError, match="len\\(tokens\\) - 1 = 6"):
        mr.sample_routes(all_layers, 7, args)
    with pytest.raises(ValueError, match="outside"):
        mr.sample_routes(all_layers + 4, 6, args)
    other = routes[:2] + 1
    padded = mr.padded_layout([routes, other], 7, args)  # [layers, S, B, k]
    assert padded.shape == (1, 7, 2, 2)
    assert torch.equal(padded[0, :5, 0], routes[:, 0]) and torch.equal(padded[0, :2, 1], other[:, 0])
    assert torch.equal(padded[0, 5, 0], torch.tensor([0, 1]))  # no record: filler
    packed = mr.packed_layout([routes, other], [6, 3], 10, args)  # [layers, total, 1, k]
    assert torch.equal(packed[0, :5, 0], routes[:, 0]) and torch.equal(packed[0, 6:8, 0], other[:, 0])
    flat = mr.per_layer(padded)
    assert flat[0].shape == (14, 2) and torch.equal(flat[0][1], padded[0, 0, 1])  # sequence-major
    assert mr.per_layer(padded, tp_rank=1, tp_size=7, sequence_parallel=True)[0].shape == (2, 2)


# ---------------------------------------------------------------------------------------------- the rollout side
def _encoded(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def test_rollout_records_routed_experts_across_turns():
    rng = np.random.default_rng(0)
    sample = Sample(tokens=[1, 2, 3], response_length=0)
    assert routing.routing_request(sample) == {"routed_experts_prompt_start": 0}
    sample.append_response_tokens([4, 5], None, [0, 0])
    first = rng.integers(0, 128, (4, 3, 2)).astype(np.uint8)  # prompt + response - 1 rows
    routing.record_routed_experts(sample, _encoded(first))
    assert np.array_equal(sample.rollout_routed_experts, first)
    sample.append_response_tokens([6], None, [0], loss_mask=[0])  # a tool's token: no routing yet
    start = routing.routing_request(sample)["routed_experts_prompt_start"]
    assert start == 4
    sample.append_response_tokens([7, 8], None, [1, 1])
    second = rng.integers(0, 128, (3, 3, 2)).astype(np.uint8)  # tokens 4 .. 6 (the last has none)
    routing.record_routed_experts(sample, _encoded(second), prompt_start=start)
    assert np.array_equal(sample.rollout_routed_experts, np.concatenate([first, second]))
    assert len(sample.rollout_routed_experts) == len(sample.tokens) - 1
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        routing.record_routed_experts(sample, None)
    with pytest.raises(ValueError, match="rows of routed experts"):
        routing.record_routed_experts(sample, _encoded(second))
    with pytest.raises(ValueError, match="base64 .npy"):
        routing.record_routed_experts(sample, "not base64 npy")


# ---------------------------------------------------------------------------------------------- training
def make_samples(seed: int, groups: int = 2, routes: bool = False) -> list[Sample]:
    """test_megatron_backend's samples, with routes recorded as vLLM reports them (every token but the
    last, every decoder layer) when asked."""
    samples = backend_samples(seed, groups)
    if routes:
        rng = random.Random(seed)
        for sample in samples:
            sample.rollout_routed_experts = np.array(
                [[rng.sample(range(4), 2) for _ in range(2)] for _ in range(len(sample.tokens) - 1)], np.uint8
            )
    return samples


def _specs(model_dir, **moe):
    from vime.backends.megatron_spec import MegatronBackendSpec

    return (
        trainer_spec(model_dir, use_kl_loss=True, kl_loss_coef=0.1),
        MegatronBackendSpec(model=model_args_from_hf(AutoConfig.from_pretrained(model_dir)), moe=mm.MoeOptions(**moe)),
    )


def test_an_rl_step_on_an_moe_model_matches_the_torch_backend(model_dir):
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.torch_backend import TorchBackend

    spec, megatron_spec = _specs(model_dir)
    ours = MegatronBackend(spec, megatron_spec).train_rollout(make_samples(0), 0)
    theirs = TorchBackend(_specs(model_dir)[0]).train_rollout(make_samples(0), 0)
    assert_same_metrics(ours, theirs)


def test_an_rl_step_with_routing_replay_and_aux_loss(model_dir):
    from vime.backends.megatron_backend import MegatronBackend

    backend = MegatronBackend(*_specs(model_dir, routing_replay=True, aux_loss_coeff=0.01))
    before = {n: p.detach().clone() for n, p in backend.gpt.named_parameters()}
    replayed = backend.train_rollout(make_samples(0, routes=True), 0)
    assert np.isfinite(replayed["loss"]) and replayed["grad_norm"] > 0
    changed = {n for n, p in backend.gpt.named_parameters() if not torch.equal(p, before[n])}
    assert "decoder.layers.0.mlp.router.weight" in changed
    # the in-run export names every expert as the HF checkpoint does
    assert {n for n, _ in backend.hf_named_weights()} == set(read_hf_state_dict(model_dir))
    # forcing other experts than the router's own changes the old policy's log-probs
    free = MegatronBackend(*_specs(model_dir)).train_rollout(make_samples(0), 0)
    assert replayed["train_rollout_logprob_abs_diff"] != pytest.approx(free["train_rollout_logprob_abs_diff"])
    with pytest.raises(ValueError, match="^--use-rollout-routing-replay: sample 0 of group 0 has no rollout_routed"):
        backend.train_rollout(make_samples(1), 0)
