"""--use-distributed-optimizer on the torch backend: FSDP2 over two gloo ranks (spawned CPU processes).

The reference is the unsharded backend in this process: the two sharded ranks must take its steps (loss,
grad norm, updated parameters, up to the order of float32 additions), each holding about half of the
parameters and of AdamW's state. Three micro-batches of which two per optimizer step: in the second step
rank 1 has no micro-batch and in the no-gradient passes one forward fewer, so the lock-step passes are
exercised. Checkpoints are resumed across rank counts (2 -> 1 here, 1 -> 2 in the ranks), and the exported
HF weights are the gathered parameters.
"""

import dataclasses
import datetime
import json
import os
import random

import pytest
import torch

from tests.gloo_ranks import join_group, leave_group, run_ranks
from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec
from vime.config.algorithm import AlgorithmConfig
from vime.runtime.ports import free_port
from vime.sample import Sample

GROUP = 4
GROUPS = 3  # x 4 samples = 3 micro-batches of 4; global batch 8: optimizer steps of 2 and 1 micro-batches
KL = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}  # the reference model is sharded too
PPO = {"advantage_estimator": "ppo", "kl_coef": 0.05}  # and PPO's critic


def make_samples(seed: int) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for g in range(GROUPS):
        prompt = [rng.randint(1, 10) for _ in range(rng.randint(2, 4))] + [11]
        for i in range(GROUP):
            response = [rng.randint(1, 11) for _ in range(rng.randint(2, 6))]
            sample = Sample(
                group_index=g,
                index=i,
                tokens=prompt + response,
                response_length=len(response),
                reward=float(rng.random() < 0.5) + 0.1 * i,
                status=Sample.Status.COMPLETED,
            )
            sample.loss_mask = [1] * len(response)
            sample.weight_versions = [0] * len(response)
            sample.rollout_log_probs = [-2.0 - 0.1 * rng.random() for _ in response]
            samples.append(sample)
    return samples


def spec(model_dir: str, *, sharded: bool, bf16: bool = False, **algorithm) -> TorchTrainerSpec:
    algo = AlgorithmConfig(**algorithm)
    algo.validate()
    return TorchTrainerSpec(
        hf_checkpoint=model_dir,
        lr=1e-3,
        weight_decay=0.01,
        adam_betas=(0.9, 0.999),
        adam_eps=1e-8,
        clip_grad=1.0,
        micro_batch_size=4,
        global_batch_size=2 * GROUP,
        n_samples_per_prompt=GROUP,
        rollout_temperature=1.0,
        algorithm=algo,
        seed=0,
        threads=1,
        bf16=bf16,
        use_distributed_optimizer=sharded,
    )


def bf16_moments_spec(model_dir: str) -> TorchTrainerSpec:
    """Float32 compute with AdamW's moments stored in bf16: what differs from the float32 run is their rounding."""
    return dataclasses.replace(spec(model_dir, sharded=True, **KL), exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def local_numel(backend: TorchBackend) -> dict[str, int]:
    """This rank's elements of the policy's parameters and of AdamW's moments."""

    def local(t):
        return t.to_local().numel() if hasattr(t, "to_local") else t.numel()

    moments = sum(
        local(value)
        for state in backend.optimizer.state.values()
        for key, value in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    return {"params": sum(local(p) for p in backend.model.parameters()), "moments": moments}


def _rank(rank: int, port: int, model_dir: str, work: str) -> None:
    # A rank left out of FSDP's collectives (a missing lock-step pass) fails the test instead of hanging it.
    join_group(rank, port, timeout=datetime.timedelta(seconds=60))
    results = {}
    backend = TorchBackend(spec(model_dir, sharded=True, **KL))
    assert backend.sharding.active and backend.dp.size == 2
    assert backend.packing  # FSDP's wrapped classes still take sequences packed back to back
    results["first"] = backend.train_rollout(make_samples(0), 0)
    results["numel"] = local_numel(backend)
    results["gathered"] = backend.sharding.full_state_dict(backend.model)  # rank 0's; {} on rank 1
    if rank == 0:  # what TrainerWorker.publish_weights does on each rank
        backend.save_weights(os.path.join(work, "exported"))
    else:
        backend.export_peer()
    backend.save_training_state(os.path.join(work, "ckpt_two_ranks"))
    results["second"] = backend.train_rollout(make_samples(1), 0)
    # 1 -> 2: the checkpoint the test wrote with one rank before starting these processes
    resumed = TorchBackend(spec(model_dir, sharded=True, **KL))
    resumed.load_training_state(os.path.join(work, "ckpt_one_rank"))
    results["second_from_one_rank"] = resumed.train_rollout(make_samples(1), 0)
    ppo = TorchBackend(
        spec(model_dir, sharded=True, megatron_config_path=os.path.join(work, "critic_save.yaml"), **PPO)
    )
    assert ppo.packing  # the sharded critic's body too
    results["ppo"] = [ppo.train_rollout(make_samples(seed), 0) for seed in (0, 1)]
    ppo.save_training_state(os.path.join(work, "ckpt_ppo"))  # also the critic's role `save` copy (gathered)
    results["critic_gathered"] = ppo.sharding.full_state_dict(ppo.critic.module)
    # --log-probs-chunk-size reads the LM head's weight after the root's forward (FSDP keeps it gathered)
    chunked = TorchBackend(dataclasses.replace(spec(model_dir, sharded=True, **KL), log_probs_chunk_size=3))
    results["chunked"] = chunked.train_rollout(make_samples(0), 0)
    bf16 = TorchBackend(spec(model_dir, sharded=True, bf16=True, **KL))
    results["bf16"] = bf16.train_rollout(make_samples(0), 0)
    results["bf16_dtypes"] = sorted(
        {str(p.dtype) for p in bf16.model.parameters()}
        | {str(v.dtype) for s in bf16.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")}
    )
    # AdamW's moments in bf16 (--exp-avg-dtype / --exp-avg-sq-dtype bf16), sharded like float32 ones
    moments = TorchBackend(bf16_moments_spec(model_dir))
    results["bf16_moments"] = moments.train_rollout(make_samples(0), 0)
    results["bf16_moments_numel"] = local_numel(moments)
    results["bf16_moments_dtypes"] = sorted(
        {str(v.dtype) for s in moments.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")}
    )
    moments.save_training_state(os.path.join(work, "ckpt_bf16_moments"))
    results["bf16_moments_second"] = moments.train_rollout(make_samples(1), 0)
    torch.save(results, os.path.join(work, f"rank{rank}.pt"))
    leave_group()


def assert_same_metrics(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        if name != "train_seconds":
            assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(
        str(tmp_path_factory.mktemp("fsdp_tiny")), hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    """One unsharded rank: two rollouts in a row, the parameters after the first."""
    single = TorchBackend(spec(model_dir, sharded=False, **KL))
    first = single.train_rollout(make_samples(0), 0)
    after_first = {name: p.detach().clone() for name, p in single.model.named_parameters()}
    total = local_numel(single)
    second = single.train_rollout(make_samples(1), 0)
    ppo = TorchBackend(spec(model_dir, sharded=False, **PPO))
    return {
        "first": first,
        "second": second,
        "after_first": after_first,
        "numel": total,
        "ppo": [ppo.train_rollout(make_samples(seed), 0) for seed in (0, 1)],
    }


@pytest.fixture(scope="module")
def work(model_dir, tmp_path_factory):
    """The two ranks' results, after a one-rank sharded-format checkpoint was written for them to resume."""
    folder = str(tmp_path_factory.mktemp("fsdp_work"))
    one = TorchBackend(spec(model_dir, sharded=True, **KL))
    assert not one.sharding.active  # one rank: nothing to shard, the checkpoint format is the sharded one
    one.train_rollout(make_samples(0), 0)
    one.save_training_state(os.path.join(folder, "ckpt_one_rank"))
    with open(os.path.join(folder, "critic_save.yaml"), "w") as f:
        f.write(f"megatron:\n  - role: critic\n    overrides:\n      save: {os.path.join(folder, 'critic_save')}\n")
    run_ranks(_rank, (free_port(), model_dir, folder), 2)
    ranks = [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    return folder, ranks


def test_two_sharded_ranks_take_one_unsharded_ranks_step(work, reference):
    _, ranks = work
    for rank in ranks:
        assert rank["first"]["optimizer_steps"] == 2.0
        assert_same_metrics(rank["first"], reference["first"])  # loss, grad_norm (global), kl, entropy...
        assert_same_metrics(rank["second"], reference["second"])
    gathered = ranks[0]["gathered"]
    assert gathered.keys() == reference["after_first"].keys() and ranks[1]["gathered"] == {}
    for name, param in reference["after_first"].items():
        torch.testing.assert_close(gathered[name], param, rtol=0, atol=1e-6, msg=name)


def test_each_rank_holds_half_of_the_parameters_and_optimizer_state(work, reference):
    _, ranks = work
    total = reference["numel"]
    assert total["moments"] == 2 * total["params"]
    for rank in ranks:
        # dim-0 shards: a tensor whose first dimension is odd leaves one row more on rank 0
        assert abs(rank["numel"]["params"] - total["params"] / 2) <= 0.01 * total["params"]
        assert abs(rank["numel"]["moments"] - total["moments"] / 2) <= 0.01 * total["moments"]
    assert sum(rank["numel"]["params"] for rank in ranks) == total["params"]


def test_two_rank_checkpoint_resumes_on_one_rank(work, model_dir, reference):
    folder, ranks = work
    assert os.path.isdir(os.path.join(folder, "ckpt_two_ranks", "sharded"))
    assert not os.path.exists(os.path.join(folder, "ckpt_two_ranks", "model"))  # not the unsharded format
    resumed = TorchBackend(spec(model_dir, sharded=True, **KL))
    resumed.load_training_state(os.path.join(folder, "ckpt_two_ranks"))
    assert resumed.rollouts_trained == 1 and resumed.actor.optimizer_steps == 2
    second = resumed.train_rollout(make_samples(1), 0)
    assert_same_metrics(second, reference["second"])
    assert_same_metrics(second, ranks[0]["second"])


def test_one_rank_checkpoint_resumes_on_two_ranks(work, reference):
    _, ranks = work
    for rank in ranks:
        assert_same_metrics(rank["second_from_one_rank"], reference["second"])


def test_exported_hf_weights_are_the_gathered_parameters(work, reference):
    from safetensors.torch import load_file

    folder, ranks = work
    exported = os.path.join(folder, "exported")
    weights = {}
    for name in os.listdir(exported):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(exported, name)))
    gathered = ranks[0]["gathered"]
    assert weights.keys() == gathered.keys()
    for name, tensor in gathered.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(weights[name], reference["after_first"][name], rtol=0, atol=1e-6, msg=name)
    with open(os.path.join(exported, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]  # the engines' class, not FSDP's


def test_ppo_actor_and_critic_sharded(work, reference):
    _, ranks = work
    for rank in ranks:
        for got, expected in zip(rank["ppo"], reference["ppo"]):
            assert_same_metrics(got, expected)


def test_critic_role_save_copy_is_the_gathered_critic(work):
    from vime.backends.value_model import ValueModel, resolve_critic_load

    folder, ranks = work
    saved, is_checkpoint = resolve_critic_load(os.path.join(folder, "critic_save"), "save", None)
    assert is_checkpoint and saved.endswith("iter_0000002")
    critic = ValueModel.from_pretrained(os.path.join(saved, "model"))
    critic.load_head(saved)
    gathered = ranks[0]["critic_gathered"]
    assert critic.state_dict().keys() == gathered.keys()
    for name, tensor in critic.state_dict().items():
        torch.testing.assert_close(tensor, gathered[name], rtol=0, atol=0, msg=name)


def test_chunked_log_probs_on_sharded_ranks(work, reference):
    _, ranks = work
    for rank in ranks:
        assert_same_metrics(rank["chunked"], reference["first"])


def test_bf16_sharded_keeps_float32_masters_and_moments(work, reference):
    _, ranks = work
    for rank in ranks:
        assert rank["bf16_dtypes"] == ["torch.float32"]
        # bf16 compute: close to the float32 step, not equal
        assert rank["bf16"]["loss"] == pytest.approx(reference["first"]["loss"], abs=0.05)


def test_unsharded_checkpoint_is_refused_by_a_sharded_run(model_dir, tmp_path):
    plain = TorchBackend(spec(model_dir, sharded=False, **KL))
    plain.save_training_state(str(tmp_path / "plain"))
    sharded = TorchBackend(spec(model_dir, sharded=True, **KL))
    with pytest.raises(ValueError, match="--use-distributed-optimizer"):
        sharded.load_training_state(str(tmp_path / "plain"))


def test_one_rank_bf16_sharded_format_checkpoint_resumes_exactly(model_dir, tmp_path):
    """One rank with --bf16 steps float32 masters (no FSDP); the sharded-format checkpoint holds those."""
    continuous = TorchBackend(spec(model_dir, sharded=True, bf16=True, **KL))
    continuous.train_rollout(make_samples(0), 0)
    continuous.save_training_state(str(tmp_path / "ckpt"))
    expected = continuous.train_rollout(make_samples(1), 0)
    resumed = TorchBackend(spec(model_dir, sharded=True, bf16=True, **KL))
    resumed.load_training_state(str(tmp_path / "ckpt"))
    assert {p.dtype for p in resumed.actor.parameters()} == {torch.float32}  # the masters were loaded
    # --no-load-optim: the same masters, AdamW without moments (loaded before `resumed` trains on).
    fresh = TorchBackend(spec(model_dir, sharded=True, bf16=True, **KL))
    fresh.load_training_state(str(tmp_path / "ckpt"), optimizer=False)
    assert not fresh.optimizer.state and fresh.actor.optimizer_steps == 0 and fresh.rollouts_trained == 1
    for a, b in zip(resumed.actor.parameters(), fresh.actor.parameters()):
        assert torch.equal(a, b)
    got = resumed.train_rollout(make_samples(1), 0)
    for name in ("loss", "grad_norm", "kl_loss"):
        assert got[name] == expected[name], name


def test_bf16_moments_are_sharded_and_resume_on_one_rank(work, model_dir, reference):
    folder, ranks = work
    for rank in ranks:
        assert rank["bf16_moments_dtypes"] == ["torch.bfloat16"]
        assert rank["bf16_moments_numel"] == rank["numel"]  # each rank holds half of the moments, as in float32
        # The first optimizer step's loss and gradients do not depend on the moments; the rounding shows after it.
        assert rank["bf16_moments"]["loss"] == pytest.approx(reference["first"]["loss"], rel=1e-3)
    resumed = TorchBackend(bf16_moments_spec(model_dir))
    resumed.load_training_state(os.path.join(folder, "ckpt_bf16_moments"))
    state = [v for s in resumed.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    assert state and {v.dtype for v in state} == {torch.bfloat16}  # the moments were loaded in their dtype
    assert_same_metrics(resumed.train_rollout(make_samples(1), 0), ranks[0]["bf16_moments_second"])


def test_the_input_embeddings_are_a_group_of_their_own_unless_tied():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vime.backends.fsdp import separate_embedding_groups

    shape = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    untied = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=False))
    assert separate_embedding_groups(untied) == [untied.get_input_embeddings()]
    tied = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    assert tied.lm_head.weight is tied.get_input_embeddings().weight
    assert separate_embedding_groups(tied) == []  # the head needs the shared weight where the root gathers it
