"""Megatron-LM's own flags, passed through when a Megatron-LM checkout is importable (vime/config/megatron_lm.py).

Megatron-LM is a source checkout, not a package CI can install, so two tests stand a small module in for its
``megatron.training.arguments``: it declares a few of Megatron-LM's real flags with Megatron-LM's types. Without
it (this environment has megatron-core only) a flag vime does not declare is refused, naming it.
"""

import argparse
import sys

import pytest

from tests.train_args import minimal_train_argv as base
from vime.config import ConfigError, parse_train_args
from vime.config.megatron_lm import Passthrough, parse_passthrough, transformer_overrides

pytest.importorskip("megatron.core")

STAND_IN = """
def add_megatron_arguments(parser):
    group = parser.add_argument_group("network size")
    group.add_argument("--init-method-std", type=float, default=0.02)
    group.add_argument("--apply-residual-connection-post-layernorm", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--overlap-grad-reduce", action="store_true")
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--train-iters", dest="num_rollout", type=int)
    return parser
"""


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.fixture
def megatron_lm_checkout(tmp_path, monkeypatch):
    """A folder holding ``megatron/training/arguments.py`` (the stand-in) on sys.path, as PYTHONPATH puts a
    checkout there. ``megatron`` is a namespace package, so it joins the installed ``megatron.core``."""
    package = tmp_path / "checkout" / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "arguments.py").write_text(STAND_IN)
    monkeypatch.syspath_prepend(str(tmp_path / "checkout"))
    yield
    for name in [n for n in sys.modules if n.startswith("megatron.training")]:
        del sys.modules[name]


def test_without_a_checkout_an_unknown_flag_is_refused_naming_it(model_dir):
    with pytest.raises(ConfigError, match=r"^--overlap-grad-reduce: not a vime flag .* Megatron-LM checkout"):
        parse_train_args(base(model_dir, "--overlap-grad-reduce"))
    with pytest.raises(ConfigError, match="^--no-such-flag: not a vime flag"):
        parse_train_args(base(model_dir, "--no-such-flag", "3"))
    # Abbreviations of vime's flags are not taken: they could be Megatron-LM flags.
    with pytest.raises(ConfigError, match="^--rollout-batch: not a vime flag"):
        parse_train_args(base(model_dir, "--rollout-batch", "4"))


def test_megatron_lm_flags_pass_through_to_args(model_dir, megatron_lm_checkout):
    s = parse_train_args(base(model_dir, "--init-method-std=0.5", "--overlap-grad-reduce", "--lr", "1e-4"))
    assert s.megatron_lm.values == {"init_method_std": 0.5, "overlap_grad_reduce": True}
    assert s.megatron_lm.flags["init_method_std"] == "--init-method-std"
    assert s.args.init_method_std == 0.5 and s.args.overlap_grad_reduce and s.train.lr == 1e-4
    # --use-distributed-optimizer and --bf16 are vime's own flags now: parsed by vime, never passed through.
    s = parse_train_args(base(model_dir, "--use-distributed-optimizer", "--bf16"))
    assert s.train.use_distributed_optimizer and s.train.bf16 and not s.megatron_lm.values
    with pytest.raises(ConfigError, match="^--no-such-flag: not a vime flag .* nor one of the Megatron-LM"):
        parse_train_args(base(model_dir, "--init-method-std", "0.5", "--no-such-flag"))
    with pytest.raises(ConfigError, match="^--train-iters: Megatron-LM's flag sets 'num_rollout', which a vime flag"):
        parse_train_args(base(model_dir, "--train-iters", "3"))


def test_transformer_config_fields_reach_the_model_and_vimes_own_are_refused(model_dir):
    given = Passthrough(
        values={
            "init_method_std": 0.5,
            "apply_residual_connection_post_layernorm": True,
            "use_distributed_optimizer": True,
        },
        flags={
            "init_method_std": "--init-method-std",
            "apply_residual_connection_post_layernorm": "--apply-residual-connection-post-layernorm",
            "use_distributed_optimizer": "--use-distributed-optimizer",
        },
    )
    assert transformer_overrides(given) == {"init_method_std": 0.5, "apply_residual_connection_post_layernorm": True}
    with pytest.raises(ConfigError, match=r"^--bf16: sets TransformerConfig.bf16, which vime sets itself"):
        transformer_overrides(Passthrough(values={"bf16": True}, flags={"bf16": "--bf16"}))

    from tests import megatron_shim
    from tests.unit.test_megatron_backend import megatron_spec, trainer_spec
    from vime.backends.megatron_backend import MegatronBackend

    megatron_shim.install()
    model = megatron_shim.tiny_qwen2_with_tokenizer(model_dir + "/model")
    backend = MegatronBackend(trainer_spec(model), megatron_spec(model, config_overrides={"init_method_std": 0.5}))
    assert backend.gpt.config.init_method_std == 0.5


def test_a_checkout_that_does_not_import_is_named_with_the_reason(model_dir, tmp_path, monkeypatch):
    package = tmp_path / "broken" / "megatron" / "training"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "arguments.py").write_text("import module_megatron_lm_needs_but_is_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path / "broken"))
    try:
        with pytest.raises(
            ConfigError,
            match="^--init-method-std: not a vime flag, and the Megatron-LM checkout .* "
            "does not import: No module named 'module_megatron_lm_needs",
        ):
            parse_train_args(base(model_dir, "--init-method-std", "0.5"))
    finally:
        for name in [n for n in sys.modules if n.startswith("megatron.training")]:
            del sys.modules[name]


def test_parse_passthrough_keeps_what_was_given():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--init-method-std", type=float, default=0.02)
    parser.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    given = parse_passthrough(["--no-masked-softmax-fusion"], argparse.Namespace(), parser)
    assert given.values == {"masked_softmax_fusion": False}  # the default of the other flag is not "given"
    assert given.flags == {"masked_softmax_fusion": "--no-masked-softmax-fusion"}
    assert parse_passthrough([], argparse.Namespace(), parser) == Passthrough()
