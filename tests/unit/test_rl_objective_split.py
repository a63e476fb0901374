"""The RL objective lives once, in vime/rl/, and the backends only own the model (issue 16, item 1).

Importing the objective must not bring in a backend (nor megatron-core, transformers or FSDP): that is what
keeps precision, sharding and batching properties of the backend. Both backends implement the protocol the
training loop runs them through.
"""

import inspect
import subprocess
import sys

import pytest

from vime.backends.protocol import TrainerBackend


def test_the_objective_imports_no_backend():
    code = (
        "import sys, vime.rl.objective, vime.rl.batch; "
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith(('vime.backends', 'megatron', "
        "'transformers', 'workers')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [], f"vime.rl.objective imports {out}"


def test_the_protocol_module_imports_no_backend():
    code = "import sys, vime.backends.protocol; print([m for m in sys.modules if m.startswith('vime.backends.')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['vime.backends.protocol']"


def _protocol_methods() -> list[str]:
    return [
        name for name, value in vars(TrainerBackend).items() if inspect.isfunction(value) and not name.startswith("_")
    ]


# What each backend writes itself: the model ops and the files (the loop, offload and reload are shared).
OWN = {
    "forward",
    "critic_values",
    "sum_gradients",
    "finish_gradients",
    "hf_named_weights",
    "save_weights",
    "save_hf",
    "export_peer",
    "save_training_state",
    "load_training_state",
}


@pytest.mark.parametrize(
    "module, name",
    [("vime.backends.torch_backend", "TorchBackend"), ("vime.backends.megatron_backend", "MegatronBackend")],
)
def test_both_backends_implement_the_protocol(module, name):
    import importlib

    from vime.backends.rollout_training import RolloutTraining

    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, RolloutTraining)
    methods = _protocol_methods()
    assert OWN | {"train_rollout", "offload", "reload"} <= set(methods)
    assert OWN <= set(vars(cls)), f"{name} lacks {sorted(OWN - set(vars(cls)))}"
    for method in methods:
        protocol_params = list(inspect.signature(getattr(TrainerBackend, method)).parameters)
        assert list(inspect.signature(getattr(cls, method)).parameters)[: len(protocol_params)] == protocol_params, (
            f"{name}.{method} does not take the protocol's arguments"
        )


def test_the_megatron_backend_no_longer_inherits_the_torch_backend():
    from vime.backends.megatron_backend import MegatronBackend
    from vime.backends.torch_backend import TorchBackend

    assert not issubclass(MegatronBackend, TorchBackend)


def test_the_objective_is_the_loss_of_a_forward_with_no_model():
    """The objective computes a loss from a Forward alone: PPO's clipped loss on a hand-made micro-batch equals
    the formula (per-token mean over the step's tokens, advantages 1, old = new so ratio 1)."""
    import collections

    import torch

    from vime.config.algorithm import AlgorithmConfig
    from vime.rl.batch import Forward, pack
    from vime.rl.objective import RLObjective
    from vime.sample import Sample

    samples = [Sample(index=i, group_index=0, tokens=[1, 2, 3, 4], response_length=2, reward=1.0) for i in range(2)]
    batch = pack(samples, pad_id=0)
    log_probs = torch.full(batch.targets.shape, -1.0, requires_grad=True)
    objective = RLObjective(
        AlgorithmConfig(calculate_per_token_loss=True),
        n_samples_per_prompt=2,
        rollout_temperature=1.0,
        hf_checkpoint="unused",
    )
    metrics, terms = collections.defaultdict(list), collections.defaultdict(float)
    advantages = torch.ones(batch.targets.shape) * batch.response_mask
    loss, _ = objective.policy_loss(
        batch,
        Forward(log_probs, entropy=torch.zeros(batch.targets.shape)),
        log_probs.detach(),
        None,
        advantages,
        {"num_samples": 2, "num_tokens": float(batch.response_mask.sum())},
        terms,
        metrics,
    )
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.0)  # -A * ratio, averaged over the 4 response tokens
    assert metrics["pg_clipfrac"] == [0.0] and terms["pg_loss"] == pytest.approx(-1.0)
    # d loss / d log p = -A / tokens at the response tokens, 0 elsewhere.
    torch.testing.assert_close(log_probs.grad, -batch.response_mask / 4)
