"""The Megatron backend (TP=1, CPU through tests/megatron_shim.py): same numbers as the torch backend,
hooks, the trainer worker's backend choice, weight publication and checkpoints in both formats."""

import os
import random

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from tests import megatron_shim  # noqa: E402
from tests.numerics import ADAMW_WEIGHT_ATOL  # noqa: E402
from vime.backends.megatron_args import model_args_from_hf  # noqa: E402
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.backends.megatron_spec import MegatronBackendSpec  # noqa: E402
from vime.backends.torch_backend import TorchBackend, TorchTrainerSpec  # noqa: E402
from vime.config.algorithm import AlgorithmConfig  # noqa: E402
from vime.sample import Sample  # noqa: E402

GROUP = 4


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path_factory.mktemp("megatron_tiny")))


def make_samples(seed: int, groups: int = 2) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
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
            sample.loss_mask[min(1, len(response) - 1)] = 0 if i == 2 else 1
            sample.weight_versions = [0] * len(response)
            sample.rollout_log_probs = [-2.0 - 0.1 * rng.random() for _ in response]
            samples.append(sample)
    return samples


def trainer_spec(model_dir, **algorithm) -> TorchTrainerSpec:
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
    )


def megatron_spec(model_dir, **overrides) -> MegatronBackendSpec:
    return MegatronBackendSpec(model=model_args_from_hf(AutoConfig.from_pretrained(model_dir)), **overrides)


def assert_same_metrics(ours: dict, theirs: dict) -> None:
    assert set(ours) == set(theirs)
    for name, value in theirs.items():
        if name != "train_seconds":
            assert ours[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name


def assert_same_weights(backend: MegatronBackend, hf_model) -> None:
    exported = dict(backend.hf_named_weights())
    reference = dict(hf_model.named_parameters())
    assert exported.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor.detach(), rtol=0, atol=ADAMW_WEIGHT_ATOL, msg=name)


ALGORITHMS = {
    "grpo": {},
    "kl_loss_entropy_reference": {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
    "gspo_tis": {"advantage_estimator": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "use_tis": True},
    "opd": {"use_opd": True, "opd_kl_coef": 0.5},
    "score_centering_tis": {"use_score_centering": True, "score_centering_top_k": 3, "use_tis": True},
    # The reference framework's objective hooks (issue 19): the objective runs them the same on both backends.
    "custom_loss": {
        "loss_type": "custom_loss",
        "custom_loss_function_path": "tests.plugins.objective_hooks.reinforce_loss",
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
    },
    "custom_advantages_reducer_unbiased_kl": {
        "custom_advantage_function_path": "tests.plugins.objective_hooks.scaled_advantages",
        "custom_pg_loss_reducer_function_path": "tests.plugins.objective_hooks.constant_reducer",
        "disable_rewards_normalization": True,
        "use_kl_loss": True,
        "kl_loss_coef": 0.1,
        "use_unbiased_kl": True,
    },
}


def with_heads(samples: list[Sample], k: int = 3) -> list[Sample]:
    """The sampler's top-k heads (ids and log-probs) at each response token, as score centering reads them."""
    rng = random.Random(7)
    for sample in samples:
        ids = [rng.sample(range(12), k) for _ in range(sample.response_length)]
        sample.rollout_topk_token_ids = np.array(ids)
        sample.rollout_topk_log_probs = np.array([[-0.5 - 0.7 * j - 0.1 * rng.random() for j in range(k)] for _ in ids])
    return samples


def with_teacher(samples: list[Sample]) -> list[Sample]:
    for sample in samples:
        sample.teacher_log_probs = [-1.5 - 0.05 * (t % 3) for t in range(sample.response_length)]
    return samples


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_training_matches_the_torch_backend(model_dir, name):
    torch_backend = TorchBackend(trainer_spec(model_dir, **ALGORITHMS[name]))
    megatron = MegatronBackend(trainer_spec(model_dir, **ALGORITHMS[name]), megatron_spec(model_dir))
    for rollout in range(2):
        samples = make_samples(rollout)
        samples = {"opd": with_teacher, "score_centering_tis": with_heads}.get(name, list)(samples)
        assert_same_metrics(megatron.train_rollout(samples, 0), torch_backend.train_rollout(samples, 0))
    assert_same_weights(megatron, torch_backend.model)
    assert megatron.rollouts_trained == 2


def test_hooks_receive_the_reference_signatures(model_dir, tmp_path):
    import argparse

    hooks = tmp_path / "my_hooks.py"  # each hook records its call into the run's args, which all receive
    hooks.write_text(
        "def init(args):\n    args.calls.append(('init',))\n"
        "def before_log_prob(args, model, store_prefix):\n"
        "    args.calls.append(('log_prob', store_prefix, len(model), type(model[0]).__name__))\n"
        "def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):\n"
        "    args.calls.append(('train_step', rollout_id, step_id, type(optimizer).__name__, opt_param_scheduler))\n"
    )
    args = argparse.Namespace(calls=[])
    spec = megatron_spec(
        model_dir,
        init_hook_path=f"{hooks}:init",
        before_log_prob_hook_path=f"{hooks}:before_log_prob",
        before_train_step_hook_path=f"{hooks}:before_train_step",
        hook_args=args,
    )
    backend = MegatronBackend(trainer_spec(model_dir, use_kl_loss=True, kl_loss_coef=0.1), spec)
    backend.train_rollout(make_samples(0), 0)
    backend.train_rollout(make_samples(1), 0)
    assert args.calls == [
        ("init",),
        ("log_prob", "", 1, "GPTModel"),
        ("log_prob", "ref_", 1, "GPTModel"),
        ("train_step", 0, 0, "AdamW", None),
        ("log_prob", "", 1, "GPTModel"),
        ("log_prob", "ref_", 1, "GPTModel"),
        ("train_step", 1, 0, "AdamW", None),
    ]


def test_a_hook_with_the_wrong_signature_is_refused(tmp_path):
    from vime.backends.megatron_hooks import load_megatron_hook
    from vime.runtime.plugins import PluginError

    (tmp_path / "bad_hooks.py").write_text("def hook(args, model):\n    pass\n")
    with pytest.raises(PluginError, match="--custom-megatron-before-log-prob-hook-path .*store_prefix"):
        load_megatron_hook("--custom-megatron-before-log-prob-hook-path", f"{tmp_path}/bad_hooks.py:hook")


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_trainer_worker_runs_megatron_publishes_hf_weights_and_resumes_exactly(model_dir, tmp_path, ckpt_format):
    from vime.queue.rollout_queue import StoreOptions
    from vime.recovery import checkpoint as ckpt
    from vime.workers.trainer_worker import TrainerWorker, TrainerWorkerSpec

    def worker():
        spec = TrainerWorkerSpec(
            backend=trainer_spec(model_dir),
            megatron=megatron_spec(model_dir, ckpt_format=ckpt_format),
            transport="object-store",
            store=StoreOptions(str(tmp_path / "queue")),
            weight_dir=str(tmp_path / "weights"),
            keep_weight_versions=2,
        )
        return TrainerWorker(spec)

    first = worker()
    assert isinstance(first.backend, MegatronBackend)
    first.backend.train_rollout(make_samples(0), 0)
    state = ckpt.CheckpointState(schema=1, step=1, weight_version=1, consumer_cursor=2, run_options={})
    folder = ckpt.save_checkpoint(str(tmp_path / "save"), state, first.save_checkpoint)
    names = os.listdir(folder)
    assert "vime_state.json" in names
    assert ("mp_rank_00" in names) if ckpt_format == "torch" else ("metadata.json" in names)
    assert open(tmp_path / "save" / ckpt.LATEST).read() == "1"

    # Published weights are an HF model: HF names, config, loadable, the trainer's logits.
    publication = first.publish_weights(1)
    hf = AutoModelForCausalLM.from_pretrained(publication.path, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 2, 3, 11, 4, 5]])
    with torch.no_grad():
        first.backend.model.eval()
        torch.testing.assert_close(
            first.backend.model(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )
        first.backend.model.train()
    assert sorted(n for n, _ in first._named_weights()) == sorted(n for n, _ in hf.named_parameters())

    after = first.backend.train_rollout(make_samples(1), 1)
    resumed = worker()
    resumed.load_checkpoint(folder)
    assert resumed.backend.rollouts_trained == 1
    again = resumed.backend.train_rollout(make_samples(1), 1)
    assert {k: v for k, v in again.items() if k != "train_seconds"} == {
        k: v for k, v in after.items() if k != "train_seconds"
    }
    for (name, a), (_, b) in zip(first.backend.hf_named_weights(), resumed.backend.hf_named_weights()):
        assert torch.equal(a, b), name
    first.shutdown()
    resumed.shutdown()


def test_actor_and_reference_start_from_ref_load(model_dir, tmp_path):
    """--ref-load (a Megatron checkpoint, e.g. from convert-hf-to-megatron) is the actor's first weights."""
    from vime.tools.convert_checkpoint import hf_to_megatron

    other = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(0.5)
    other.save_pretrained(tmp_path / "other_hf", safe_serialization=True)
    hf_to_megatron(str(tmp_path / "other_hf"), str(tmp_path / "ref"), ckpt_format="torch")
    backend = MegatronBackend(
        trainer_spec(model_dir, use_kl_loss=True, kl_loss_coef=0.1),
        megatron_spec(model_dir, ref_load=str(tmp_path / "ref")),
    )
    assert_same_weights(backend, other)
    reference = dict(backend.ref_gpt.named_parameters())
    for name, param in backend.gpt.named_parameters():
        assert torch.equal(param, reference[name]), name
