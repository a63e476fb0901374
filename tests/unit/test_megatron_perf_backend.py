"""The reference's optimizer and kernel flags on the Megatron backend (CPU through tests/megatron_shim.py):
``--optimizer sgd`` trains with SGD as the torch backend does and resumes exactly from a torch_dist checkpoint;
``--moe-router-dtype``, ``--attention-backend`` and ``--attention-softmax-in-fp32`` reach the models'
TransformerConfig (vime/config/megatron_perf.py)."""

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)

from tests import megatron_shim  # noqa: E402
from tests.train_args import minimal_train_argv as base  # noqa: E402
from tests.unit.test_megatron_backend import make_samples, megatron_spec, trainer_spec  # noqa: E402
from vime.backends.megatron_backend import MegatronBackend  # noqa: E402
from vime.backends.megatron_spec import MegatronBackendSpec  # noqa: E402
from vime.backends.torch_backend import TorchBackend  # noqa: E402
from vime.config import parse_train_args  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def shim():
    megatron_shim.install()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return megatron_shim.tiny_qwen2_with_tokenizer(str(tmp_path_factory.mktemp("megatron_tiny")))


def sgd_spec(model_dir):
    return dataclasses.replace(trainer_spec(model_dir), optimizer="sgd", sgd_momentum=0.5, lr=0.05)


def test_sgd_trains_the_megatron_backend_as_it_trains_the_torch_backend(model_dir):
    torch_backend = TorchBackend(sgd_spec(model_dir))
    megatron = MegatronBackend(sgd_spec(model_dir), megatron_spec(model_dir))
    adam = MegatronBackend(trainer_spec(model_dir), megatron_spec(model_dir))
    assert isinstance(megatron.optimizer, torch.optim.SGD) and megatron.optimizer.param_groups[0]["momentum"] == 0.5
    for rollout in range(2):
        samples = make_samples(rollout)
        megatron.train_rollout(samples, 0), torch_backend.train_rollout(samples, 0), adam.train_rollout(samples, 0)
    ours, theirs = dict(megatron.hf_named_weights()), dict(torch_backend.model.named_parameters())
    adams = dict(adam.hf_named_weights())
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor.detach(), rtol=1e-4, atol=1e-5, msg=name)
    assert any(not torch.allclose(ours[name], adams[name]) for name in ours)  # SGD is not AdamW


def test_sgd_resumes_exactly_from_a_torch_dist_checkpoint(model_dir, tmp_path):
    first = MegatronBackend(sgd_spec(model_dir), megatron_spec(model_dir, ckpt_format="torch_dist"))
    first.train_rollout(make_samples(0), 0)
    assert all("momentum_buffer" in s for s in first.optimizer.state.values())
    first.save_training_state(str(tmp_path / "iter"))
    after = first.train_rollout(make_samples(1), 1)

    resumed = MegatronBackend(sgd_spec(model_dir), megatron_spec(model_dir, ckpt_format="torch_dist"))
    resumed.load_training_state(str(tmp_path / "iter"))
    for state in resumed.optimizer.state.values():  # SGD's momentum back, no AdamW state made up
        assert set(state) == {"momentum_buffer"}
    again = resumed.train_rollout(make_samples(1), 1)
    assert {k: v for k, v in again.items() if k != "train_seconds"} == {
        k: v for k, v in after.items() if k != "train_seconds"
    }
    for (name, a), (_, b) in zip(first.hf_named_weights(), resumed.hf_named_weights()):
        assert torch.equal(a, b), name


def test_kernel_flags_reach_the_transformer_config(model_dir):
    from megatron.core.transformer.enums import AttnBackend

    from vime.backends.megatron_model import transformer_config

    # --ray-address: the trainer checks CUDA on its own node, so this CPU machine can parse a Megatron run.
    flags = ["--train-backend", "megatron", "--ray-address", "10.0.0.1:6379"]
    spec = MegatronBackendSpec.from_settings(
        parse_train_args(
            base(
                model_dir,
                *flags,
                "--attention-backend",
                "fused",
                "--attention-softmax-in-fp32",
                "--moe-router-dtype",
                "fp64",
                "--data-pad-size-multiplier",
                "512",
            )
        )
    )
    assert spec.pad_size_multiplier == 512
    assert spec.config_overrides == {"attention_backend": AttnBackend.fused, "attention_softmax_in_fp32": True}
    assert spec.moe.router_dtype == "fp64"
    config = transformer_config(spec.model, spec.parallel, moe=spec.moe, overrides=spec.config_overrides)
    assert config.attention_backend == AttnBackend.fused and config.attention_softmax_in_fp32
    # Left out: megatron-core's defaults, and vime's fp32 routing (as HF routes).
    spec = MegatronBackendSpec.from_settings(parse_train_args(base(model_dir, *flags)))
    assert spec.config_overrides is None and spec.moe.router_dtype == "fp32" and spec.pad_size_multiplier == 1


def test_the_router_dtype_reaches_a_moe_model(tmp_path):
    from transformers import AutoConfig

    from vime.backends.megatron_args import model_args_from_hf
    from vime.backends.megatron_model import MoeOptions, Parallelism, transformer_config

    moe_dir = megatron_shim.tiny_moe_hf_model(str(tmp_path / "moe"))
    args = model_args_from_hf(AutoConfig.from_pretrained(moe_dir))
    assert transformer_config(args, Parallelism(), moe=MoeOptions()).moe_router_dtype == "fp32"
    assert transformer_config(args, Parallelism(), moe=MoeOptions(router_dtype="fp64")).moe_router_dtype == "fp64"


def test_enable_experimental_sets_megatron_cores_flag_in_the_trainer(model_dir):
    from megatron.core import config as core_config

    flags = ["--train-backend", "megatron", "--ray-address", "10.0.0.1:6379", "--enable-experimental"]
    assert MegatronBackendSpec.from_settings(parse_train_args(base(model_dir, *flags))).experimental
    assert not MegatronBackendSpec.from_settings(parse_train_args(base(model_dir, *flags[:-1]))).experimental
    core_config.set_experimental_flag(False)
    try:
        MegatronBackend(trainer_spec(model_dir), megatron_spec(model_dir, experimental=True))
        assert core_config.is_experimental_enabled()
    finally:
        core_config.set_experimental_flag(False)
