"""MoE models in the Megatron backend: HF <-> Megatron naming (Qwen3-MoE, Qwen2-MoE, Mixtral), the
megatron-core GPT with MoE layers giving HF's logits, the MoE flags' start-up checks and one RL step."""

import os
import subprocess

import pytest
import torch
from transformers import AutoConfig

from tests.conftest import REPO
from tests.megatron_shim import MOE_VARIANTS, tiny_moe_hf_model
from tests.train_args import minimal_train_argv as _args, refused_against_config_json
from vime.backends.megatron_args import model_args_from_hf, parse_moe_layer_freq
from vime.backends.megatron_convert import (
    from_te_names,
    hf_to_mcore,
    mcore_to_hf,
    merge_tp_shards,
    read_hf_state_dict,
    to_te_names,
)
from vime.config import ConfigError, parse_train_args

MEGATRON_WARNINGS = pytest.mark.filterwarnings(
    "ignore::UserWarning:megatron", "ignore::DeprecationWarning:megatron", "ignore::FutureWarning"
)


@pytest.fixture(scope="module", params=sorted(MOE_VARIANTS))
def tiny(request, tmp_path_factory):
    folder = tiny_moe_hf_model(str(tmp_path_factory.mktemp(request.param)), **MOE_VARIANTS[request.param])
    return request.param, folder, model_args_from_hf(AutoConfig.from_pretrained(folder))


# ---------------------------------------------------------------------------------------------- conversion
def test_architecture_from_config_json(tiny):
    name, _, args = tiny
    assert (args.num_experts, args.moe_router_topk) == (4, 2)
    expected = {
        "qwen3_moe": dict(
            moe_ffn_hidden_size=24,
            moe_layers=(0, 1),
            moe_router_pre_softmax=False,
            moe_shared_expert_intermediate_size=None,
            qk_layernorm=True,
        ),
        "qwen2_moe": dict(
            moe_ffn_hidden_size=24,
            moe_layers=(0,),
            moe_router_pre_softmax=True,
            moe_shared_expert_intermediate_size=40,
            moe_shared_expert_gate=True,
            add_qkv_bias=True,
        ),
        "mixtral": dict(moe_ffn_hidden_size=48, moe_layers=(0, 1), moe_router_pre_softmax=False),
        "glm4_moe": dict(
            moe_ffn_hidden_size=24,
            moe_layers=(1,),
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_gate=False,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.5,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            rotary_percent=0.5,
            add_qkv_bias=True,
            qk_layernorm=True,
        ),
        "deepseek_v3": dict(
            moe_layers=(1,),
            moe_shared_expert_intermediate_size=24,
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=2.0,
            moe_router_num_groups=2,
            multi_latent_attention=True,
            q_lora_rank=12,
            kv_lora_rank=8,
            qk_head_dim=8,
            kv_channels=8,
            qk_pos_emb_head_dim=4,
            v_head_dim=6,
            num_query_groups=4,
            yarn=(
                ("rotary_scaling_factor", 4.0),
                ("original_max_position_embeddings", 16.0),
                ("beta_fast", 32.0),
                ("beta_slow", 1.0),
                ("mscale", 1.0),
                ("mscale_all_dim", 0.8),
            ),
            rope_scaling_factor=None,
        ),
        "moonlight": dict(
            moe_shared_expert_intermediate_size=48,
            moe_router_topk_scaling_factor=2.446,
            moe_router_num_groups=None,
            multi_latent_attention=True,
            q_lora_rank=None,
            v_head_dim=8,
            yarn=(),
        ),
        "qwen3_next": dict(
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_gate=True,
            moe_router_pre_softmax=False,
            moe_layers=(0, 1),
            qk_layernorm=True,
            rotary_percent=0.25,
            attention_output_gate=True,
            zero_centered_norms=True,
            linear_attention_layers=(0,),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        ),
        "qwen3_5_moe_text": dict(
            moe_shared_expert_intermediate_size=24,
            moe_shared_expert_gate=True,
            moe_router_pre_softmax=False,  # always renormalised (its config has no norm_topk_prob)
            moe_layers=(0, 1),
            rotary_percent=0.25,
            attention_output_gate=True,
            zero_centered_norms=True,
            linear_attention_layers=(0,),
        ),
        "minimax_m2": dict(
            moe_ffn_hidden_size=24,
            moe_layers=(0, 1),
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=None,
            moe_router_num_groups=None,
            moe_shared_expert_intermediate_size=None,
            qk_layernorm=True,
            qk_norm_over_heads=True,
            rotary_percent=0.5,
        ),
    }[name]
    assert {k: getattr(args, k) for k in expected} == expected


def test_hf_megatron_hf_round_trip_is_exact(tiny):
    _, folder, args = tiny
    hf = read_hf_state_dict(folder)
    back = mcore_to_hf(hf_to_mcore(hf, args), args)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_expert_names_and_shapes(tiny):
    name, folder, args = tiny
    hf = read_hf_state_dict(folder)
    mcore = hf_to_mcore(hf, args)
    first = args.moe_layers[0]
    layer = f"decoder.layers.{first}.mlp."
    mixtral_names = name in ("mixtral", "minimax_m2")
    hf_block = f"model.layers.{first}." + ("block_sparse_moe." if mixtral_names else "mlp.")
    assert torch.equal(mcore[layer + "router.weight"], hf[hf_block + "gate.weight"])
    fc1 = mcore[layer + "experts.local_experts.3.linear_fc1.weight"]
    gate, up = ("w1", "w3") if mixtral_names else ("gate_proj", "up_proj")
    expert = f"{hf_block}experts.3."
    assert torch.equal(fc1, torch.cat([hf[f"{expert}{gate}.weight"], hf[f"{expert}{up}.weight"]]))
    assert fc1.shape == (2 * args.moe_ffn_hidden_size, args.hidden_size)
    assert (layer + "linear_fc1.weight") not in mcore
    if name == "qwen2_moe":
        assert mcore[layer + "shared_experts.gate_weight"].shape == (1, args.hidden_size)
        assert mcore[layer + "shared_experts.linear_fc1.weight"].shape == (80, args.hidden_size)
        assert "decoder.layers.1.mlp.linear_fc1.weight" in mcore  # the dense layer (mlp_only_layers)
        assert "decoder.layers.1.mlp.router.weight" not in mcore
    if name == "glm4_moe":
        assert torch.equal(mcore[layer + "router.expert_bias"], hf[hf_block + "gate.e_score_correction_bias"])
        assert mcore[layer + "router.expert_bias"].abs().min() > 0  # the fixture's bias is random
        shared_down = hf[hf_block + "shared_experts.down_proj.weight"]
        assert torch.equal(mcore[layer + "shared_experts.linear_fc2.weight"], shared_down)
        assert "decoder.layers.0.mlp.linear_fc1.weight" in mcore  # the dense layer (first_k_dense_replace)
        assert "decoder.layers.0.mlp.router.weight" not in mcore
    if name == "minimax_m2":  # its bias beside the router; its query norm over all heads
        assert torch.equal(mcore[layer + "router.expert_bias"], hf[hf_block + "e_score_correction_bias"])
        query_norm = mcore[f"decoder.layers.{first}.self_attention.q_layernorm.weight"]
        assert query_norm.shape == (args.num_attention_heads * args.kv_channels,)


def test_transformer_engine_names(tiny):
    _, folder, args = tiny
    mcore = hf_to_mcore(read_hf_state_dict(folder), args)
    first = args.moe_layers[0]
    for grouped in (False, True):
        te = to_te_names(mcore, grouped_gemm=grouped)
        assert from_te_names(te).keys() == mcore.keys()
        # an MoE layer's pre-MLP norm is its own module in Transformer Engine specs too
        assert f"decoder.layers.{first}.pre_mlp_layernorm.weight" in te
    assert f"decoder.layers.{first}.mlp.experts.linear_fc2.weight3" in to_te_names(mcore, grouped_gemm=True)


def test_tensor_parallel_torch_shards_merge_back():
    import tempfile

    folder = tiny_moe_hf_model(tempfile.mkdtemp(), **MOE_VARIANTS["qwen2_moe"])
    args = model_args_from_hf(AutoConfig.from_pretrained(folder))
    mcore = hf_to_mcore(read_hf_state_dict(folder), args)
    shards = [{}, {}]
    for name, value in mcore.items():
        if name.endswith("linear_fc1.weight"):  # dense, expert and shared MLPs: [gate; up] per rank
            gate, up = value.chunk(2)
            parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2))]
        elif name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            parts = list(value.chunk(2))
        elif name.endswith(("word_embeddings.weight", "output_layer.weight")):
            parts = list(torch.cat([value, torch.zeros(128 - value.shape[0], value.shape[1])]).chunk(2))
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            parts = list(value.chunk(2, dim=1))
        else:  # norms, router, shared-expert gate: replicated
            parts = [value, value]
        for shard, part in zip(shards, parts):
            shard[name] = part
    merged = merge_tp_shards(shards, args)
    assert merged.keys() == mcore.keys() and all(torch.equal(merged[n], mcore[n]) for n in mcore)


# ---------------------------------------------------------------------------------------------- the model
def _megatron():
    pytest.importorskip("megatron.core")
    from tests import megatron_shim
    from vime.backends import megatron_model as mm

    megatron_shim.install()
    mm.init_parallel(mm.Parallelism(), seed=1234)
    return mm


def _batch():
    ids = torch.tensor(
        [[1, 2, 3, 4, 5, 11, 6, 7, 8, 9], [3, 4, 5, 11, 6, 15, 0, 0, 0, 0], [7, 7, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    return ids, (torch.arange(10) < torch.tensor([[10], [6], [2]])).long()


@MEGATRON_WARNINGS
def test_logits_match_hf(tiny):
    from transformers import AutoModelForCausalLM

    from vime.backends import megatron_forward as mf, megatron_weights as mw

    mm = _megatron()
    _, folder, args = tiny
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(folder), args), args)
    ids, mask = _batch()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ours = mf.MegatronLM(gpt.eval(), args.vocab_size, model_args=args)(input_ids=ids, attention_mask=mask).logits
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4)
    # the exported weights are the HF checkpoint's, expert by expert
    back = mcore_to_hf(mw.gather_canonical(gpt, args), args)
    hf_state = read_hf_state_dict(folder)
    assert back.keys() == hf_state.keys() and all(torch.equal(back[n], hf_state[n]) for n in hf_state)


@MEGATRON_WARNINGS
def test_checkpoint_round_trip_torch_dist(tmp_path):
    from vime.backends import megatron_checkpoint as mc, megatron_weights as mw

    mm = _megatron()
    folder = tiny_moe_hf_model(str(tmp_path / "hf"), **MOE_VARIANTS["qwen2_moe"])
    args = model_args_from_hf(AutoConfig.from_pretrained(folder))
    gpt = mm.build_gpt_model(args, mm.Parallelism(), initialize=False)
    mw.load_canonical(gpt, hf_to_mcore(read_hf_state_dict(folder), args), args)
    mc.save(str(tmp_path / "iter_0000001"), gpt, None, fmt="torch_dist", iteration=1, args=args.to_dict())
    again = mm.build_gpt_model(args, mm.Parallelism(), initialize=True)
    mc.load(str(tmp_path / "iter_0000001"), again)
    expected, got = mw.gather_canonical(gpt, args), mw.gather_canonical(again, args)
    assert all(torch.equal(expected[n], got[n]) for n in expected)


# ---------------------------------------------------------------------------------------------- flags


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return tiny_moe_hf_model(str(tmp_path_factory.mktemp("qwen3_moe_flags")), **MOE_VARIANTS["qwen3_moe"])


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    from tests.megatron_shim import tiny_hf_model

    return tiny_hf_model(str(tmp_path_factory.mktemp("dense")), "qwen3")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--moe-router-topk", "5", "--num-experts", "4"], "--moe-router-topk"),
        (["--num-experts", "0"], "--num-experts"),
        (["--moe-layer-freq", "[1]*3", "--num-layers", "2"], "--moe-layer-freq"),
        (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq"),
        (["--moe-router-load-balancing-type", "sinkhorn"], "--moe-router-load-balancing-type"),
        (["--moe-aux-loss-coeff", "-1"], "--moe-aux-loss-coeff"),
        (["--moe-router-bias-update-rate", "-0.001"], "--moe-router-bias-update-rate"),
        (["--moe-router-topk-scaling-factor", "0"], "--moe-router-topk-scaling-factor"),
        (["--moe-router-num-groups", "2"], "--moe-router-group-topk"),
        (["--moe-router-group-topk", "1"], "--moe-router-num-groups"),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"], "--moe-router-group-topk"),
        (["--moe-router-num-groups", "0", "--moe-router-group-topk", "1"], "--moe-router-num-groups"),
        (
            ["--moe-router-enable-expert-bias", "--moe-router-score-function", "softmax"],
            "--moe-router-enable-expert-bias",
        ),
    ],
)
def test_bad_moe_flags_name_the_flag(qwen3_moe_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(_args(qwen3_moe_dir, *extra))
    assert str(error.value).startswith(flag), str(error.value)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--num-experts", "8"], "--num-experts"),
        (["--moe-router-topk", "1"], "--moe-router-topk"),
        (["--moe-ffn-hidden-size", "48"], "--moe-ffn-hidden-size"),
        (["--moe-router-pre-softmax"], "--moe-router-pre-softmax"),  # norm_topk_prob: true
        (["--moe-shared-expert-intermediate-size", "40"], "--moe-shared-expert-intermediate-size"),
        (["--moe-shared-expert-gate"], "--moe-shared-expert-gate"),  # Qwen3-MoE has no shared expert
        (["--moe-router-score-function", "sigmoid"], "--moe-router-score-function"),
        (["--moe-layer-freq", "[0]+[1]*1"], "--moe-layer-freq"),
        (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias"),
        (["--moe-router-topk-scaling-factor", "2.5"], "--moe-router-topk-scaling-factor"),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"], "--moe-router-num-groups"),
    ],
)
def test_moe_flags_are_checked_against_config_json(qwen3_moe_dir, extra, flag):
    said = refused_against_config_json(qwen3_moe_dir, *extra)
    assert said.startswith(flag), said


@pytest.fixture(scope="module")
def glm4_moe_dir(tmp_path_factory):
    return tiny_moe_hf_model(str(tmp_path_factory.mktemp("glm4_moe_flags")), **MOE_VARIANTS["glm4_moe"])


# The reference's GLM-4.5 preset's routing flags (scripts/models/glm4.5-106B-A12B.sh), the tiny model's numbers.
GLM_ROUTING = [
    "--moe-router-pre-softmax",  # meaningless for a sigmoid router (megatron-core reads it for softmax only)
    "--moe-router-score-function",
    "sigmoid",
    "--moe-router-enable-expert-bias",
    "--moe-router-bias-update-rate",
    "0",
    "--moe-router-topk-scaling-factor",
    "2.5",
    "--moe-router-num-groups",
    "2",
    "--moe-router-group-topk",
    "1",
    "--rotary-percent",
    "0.5",
    "--moe-shared-expert-intermediate-size",
    "24",
    "--moe-layer-freq",
    "[0]*1+[1]*1",
]


def test_glm_routing_flags_agree_with_config_json(glm4_moe_dir):
    settings = parse_train_args(_args(glm4_moe_dir, *GLM_ROUTING))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(glm4_moe_dir), "megatron")
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(glm4_moe_dir), "torch")  # rate 0: frozen
    assert settings.megatron.moe_router_bias_update_rate == 0
    # a moving bias needs the Megatron backend: the torch backend's HF model keeps it as loaded
    moving = parse_train_args(_args(glm4_moe_dir, "--moe-router-enable-expert-bias"))
    moving.megatron.check_against_hf(AutoConfig.from_pretrained(glm4_moe_dir), "megatron")
    with pytest.raises(ConfigError, match="^--moe-router-bias-update-rate: 0.001: the torch backend keeps"):
        moving.megatron.check_against_hf(AutoConfig.from_pretrained(glm4_moe_dir), "torch")


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--moe-router-score-function", "softmax"], "--moe-router-score-function"),
        (["--moe-router-topk-scaling-factor", "1.0"], "--moe-router-topk-scaling-factor"),
        (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1"], "--moe-router-num-groups"),
        (["--moe-router-num-groups", "2", "--moe-router-group-topk", "2"], "--moe-router-group-topk"),
        (["--rotary-percent", "1.0"], "--rotary-percent"),
    ],
)
def test_glm_routing_flags_that_disagree_are_refused(glm4_moe_dir, extra, flag):
    said = refused_against_config_json(glm4_moe_dir, *extra)
    assert said.startswith(flag), said


def test_glm_configs_megatron_cannot_route_the_same_way_are_refused(tmp_path):
    import json

    folder = tiny_moe_hf_model(str(tmp_path / "glm"), **MOE_VARIANTS["glm4_moe"])
    config = json.load(open(os.path.join(folder, "config.json")))
    for change, said in [
        ({"norm_topk_prob": False}, "norm_topk_prob false"),
        ({"num_experts_per_tok": 3, "n_group": 2, "topk_group": 2}, "group-limited routing"),
    ]:
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **change}, f)
        with pytest.raises(ConfigError, match="^--hf-checkpoint: .*" + said):
            model_args_from_hf(AutoConfig.from_pretrained(folder))


def test_the_shared_expert_gate_flag_agrees_with_qwen2_moe_and_not_with_glm4_moe(tmp_path, glm4_moe_dir):
    """--moe-shared-expert-gate (the Qwen3-Next and Qwen3.5 presets pass it): Qwen2-MoE's shared expert has the
    sigmoid gate, GLM-4.5's shared expert has none."""
    qwen2_moe = tiny_moe_hf_model(str(tmp_path / "qwen2_moe"), **MOE_VARIANTS["qwen2_moe"])
    settings = parse_train_args(_args(qwen2_moe, "--moe-shared-expert-gate"))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(qwen2_moe))
    assert settings.megatron.moe_shared_expert_gate and settings.args.moe_shared_expert_gate
    said = refused_against_config_json(glm4_moe_dir, "--moe-shared-expert-gate")
    assert said.startswith("--moe-shared-expert-gate: is given but") and "no gated shared expert" in said, said


def test_moe_flags_on_a_dense_model_are_refused(dense_dir):
    settings = parse_train_args(_args(dense_dir, "--num-experts", "4"))
    with pytest.raises(ConfigError, match="^--num-experts: .*not a mixture-of-experts"):
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(dense_dir))
    settings = parse_train_args(_args(dense_dir, "--moe-shared-expert-gate"))
    with pytest.raises(ConfigError, match="^--moe-shared-expert-gate: .*not a mixture-of-experts"):
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(dense_dir))
    bias = ("--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid")
    settings = parse_train_args(_args(dense_dir, *bias))
    with pytest.raises(ConfigError, match="^--moe-router-enable-expert-bias: .*not a mixture-of-experts"):
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(dense_dir))


def test_routing_replay_needs_moe_and_the_megatron_backend(dense_dir, qwen3_moe_dir):
    settings = parse_train_args(_args(dense_dir, "--use-rollout-routing-replay"))
    with pytest.raises(ConfigError) as error:
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(dense_dir))
    assert str(error.value).startswith("--use-rollout-routing-replay: needs a mixture-of-experts model (--num-experts")
    settings = parse_train_args(_args(qwen3_moe_dir, "--use-rollout-routing-replay"))
    settings.megatron.check_against_hf(AutoConfig.from_pretrained(qwen3_moe_dir), "megatron")
    with pytest.raises(ConfigError, match="^--use-rollout-routing-replay: needs --train-backend megatron"):
        settings.megatron.check_against_hf(AutoConfig.from_pretrained(qwen3_moe_dir), "torch")


def test_moe_layer_freq_spellings():
    assert parse_moe_layer_freq("1", 3) == [1, 1, 1]
    assert parse_moe_layer_freq("2", 4) == [1, 0, 1, 0]
    assert parse_moe_layer_freq("[0]+[1]*3") == [0, 1, 1, 1]
    assert parse_moe_layer_freq("([1, 0]*2)", 4) == [1, 0, 1, 0]


def _preset(name: str) -> list[str]:
    path = os.path.join(REPO, "scripts", "models", name)
    return subprocess.run(
        ["bash", "-c", f'source "{path}" && printf "%s\\n" "${{MODEL_ARGS[@]}}"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def test_moe_presets(qwen3_moe_dir):
    from vime.backends.megatron_args import resolve_model_args

    settings = parse_train_args(_args(qwen3_moe_dir, *_preset("qwen3-moe-tiny.sh")))
    args = resolve_model_args(settings.megatron, AutoConfig.from_pretrained(qwen3_moe_dir))
    assert (args.family, args.num_experts, args.moe_layers) == ("qwen3_moe", 4, (0, 1))
    big = parse_train_args(_args(qwen3_moe_dir, *_preset("qwen3-30B-A3B.sh"))).megatron
    assert (big.num_experts, big.moe_router_topk, big.moe_ffn_hidden_size, big.moe_grouped_gemm) == (128, 8, 768, True)
    assert parse_moe_layer_freq(big.moe_layer_freq, big.num_layers) == [1] * 48


@MEGATRON_WARNINGS
@pytest.mark.parametrize(
    "family, ckpt_format",
    [("qwen2_moe", "torch"), ("qwen2_moe", "torch_dist"), ("glm4_moe", "torch"), ("deepseek_v3", "torch_dist")],
)
def test_conversion_commands_round_trip(tmp_path, family, ckpt_format):
    """HF -> Megatron -> HF is exact, the expert bias and MLA's latents included."""
    from vime.cli import main

    _megatron()
    hf = tiny_moe_hf_model(str(tmp_path / "hf"), **MOE_VARIANTS[family])
    assert (
        main(
            [
                "tools",
                "convert-hf-to-megatron",
                "--hf-checkpoint",
                hf,
                "--save",
                str(tmp_path / "mcore"),
                "--ckpt-format",
                ckpt_format,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "tools",
                "convert-megatron-to-hf",
                "--load",
                str(tmp_path / "mcore"),
                "--save",
                str(tmp_path / "back"),
                "--hf-config",
                hf,
                "--dtype",
                "float32",
            ]
        )
        == 0
    )
    left, right = read_hf_state_dict(hf), read_hf_state_dict(str(tmp_path / "back"))
    assert left.keys() == right.keys() and all(torch.equal(left[n], right[n]) for n in left)


def test_moe_under_tensor_parallelism_needs_sequence_parallelism(qwen3_moe_dir):
    """megatron-core refuses MoE training under TP without sequence parallelism: the backend names the flag
    before building anything."""
    pytest.importorskip("megatron.core")
    from vime.backends.megatron_model import Parallelism
    from vime.backends.megatron_setup import check_moe_tensor_parallelism
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = model_args_from_hf(AutoConfig.from_pretrained(qwen3_moe_dir))
    check = check_moe_tensor_parallelism
    with pytest.raises(ValueError, match="^--sequence-parallel: megatron-core trains MoE layers"):
        check(MegatronBackendSpec(model=model, parallel=Parallelism(tensor=2)))
    check(MegatronBackendSpec(model=model, parallel=Parallelism(tensor=2, sequence_parallel=True)))
    check(MegatronBackendSpec(model=model, parallel=Parallelism(tensor=1)))


def test_a_dense_model_takes_moot_expert_sizes_but_not_spread_experts(tmp_path):
    """The reference's dense scripts pass --expert-model-parallel-size 1 --expert-tensor-parallel-size 1 under
    --tensor-model-parallel-size 2: how absent experts would be split is moot; spreading them is an error."""
    pytest.importorskip("megatron.core")
    from tests.megatron_shim import tiny_hf_model
    from vime.backends.megatron_model import Parallelism
    from vime.backends.megatron_setup import check_expert_parallelism
    from vime.backends.megatron_spec import MegatronBackendSpec

    model = model_args_from_hf(AutoConfig.from_pretrained(tiny_hf_model(str(tmp_path / "dense"), "qwen2")))
    check_expert_parallelism(MegatronBackendSpec(model=model, parallel=Parallelism(tensor=2, expert_tensor=1)))
    with pytest.raises(ValueError, match="^--expert-model-parallel-size 2: qwen2 has no experts"):
        check_expert_parallelism(MegatronBackendSpec(model=model, parallel=Parallelism(expert=2)))


def test_glm_multi_token_prediction_layers_are_carried_not_converted(glm4_moe_dir, tmp_path):
    """GLM-4.5's checkpoints number their MTP layer after the decoder's last: the Megatron model leaves it out and
    the export takes it unchanged (untrained_hf_tensors); a decoder layer is never mistaken for one."""
    import shutil

    from safetensors.torch import save_file

    from vime.backends.megatron_convert import untrained_hf_tensors

    folder = str(tmp_path / "with_mtp")
    shutil.copytree(glm4_moe_dir, folder)
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(32, 64), "model.layers.2.enorm.weight": torch.randn(32)}
    save_file(mtp, os.path.join(folder, "model-mtp.safetensors"))
    args = model_args_from_hf(AutoConfig.from_pretrained(folder))
    mcore = hf_to_mcore(read_hf_state_dict(folder), args)  # (no tensor left without a counterpart)
    assert not any(name.startswith("decoder.layers.2.") for name in mcore)
    carried = untrained_hf_tensors(folder, args, mtp_layers=True)
    assert carried.keys() == mtp.keys() and all(torch.equal(carried[n], mtp[n]) for n in mtp)
    assert untrained_hf_tensors(folder, args, mtp_layers=False) == {}
