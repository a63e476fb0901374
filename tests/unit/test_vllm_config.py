"""--vllm-config: every example of the guide resolves to the documented topology, and every invalid
case is refused with the field path in the message."""

import asyncio
import logging
import os
import textwrap
import types

import pytest

from tests.train_args import minimal_train_argv as cli
from vime.config import ConfigError, parse_train_args
from vime.config.vllm_config import load_vllm_config
from vime.config.vllm_deployment import GlobalFlags, check_overrides_against_vllm, default_deployment, resolve
from vime.config.vllm_launch import build_launch_plan
from vime.rollout.model_routes import get_model_url, media_parts, prime_encoder


@pytest.fixture
def actor_dir(tmp_path):
    folder = tmp_path / "actor"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return str(folder)


def write(tmp_path, text, name="vllm.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def resolve_text(
    tmp_path, text, *, hf_checkpoint="/models/actor", gpus, per_engine=1, vllm_args=None, gpus_per_node=None
):
    config = load_vllm_config(write(tmp_path, text))
    return resolve(
        config,
        GlobalFlags(
            hf_checkpoint=hf_checkpoint,
            rollout_num_gpus=gpus,
            rollout_num_gpus_per_engine=per_engine,
            vllm_args=vllm_args or {},
            gpus_per_node=gpus_per_node,
        ),
    )


def layout(model):
    """(worker_type, engines, GPUs per engine, TP) per group."""
    return [(g.worker_type, g.num_engines, g.num_gpus_per_engine, g.tensor_parallel_size) for g in model.groups]


def refused(tmp_path, text, **kwargs) -> str:
    with pytest.raises(ConfigError) as error:
        resolve_text(tmp_path, text, **kwargs)
    assert error.value.flag == "--vllm-config"
    return error.value.message


# ------------------------------------------------------------------------- the guide's examples
def test_basic_single_model(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: default
            server_groups:
              - worker_type: regular
                num_gpus: 8
        """,
        gpus=8,
        per_engine=2,
    )
    (model,) = deployment.models
    assert model.name == "default" and model.model_path == "/models/actor"
    assert layout(model) == [("regular", 4, 2, 2)]
    assert model.update_weights and model.update_weights_inferred and not deployment.warnings
    plan = build_launch_plan(deployment)
    assert [m.router.model_name for m in plan.models] == ["default"]
    assert not plan.models[0].router.pd_disaggregation
    assert [e.router_role for e in plan.engines] == ["regular"] * 4


def test_pd_disaggregation(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            server_groups:
              - worker_type: prefill
                num_gpus: 4
                num_gpus_per_engine: 2    # 2 prefill engines, TP=2
              - worker_type: decode
                num_gpus: 12
                num_gpus_per_engine: 4    # 3 decode engines, TP=4
        """,
        gpus=16,
    )
    (model,) = deployment.models
    assert layout(model) == [("prefill", 2, 2, 2), ("decode", 3, 4, 4)]
    assert model.pd_disaggregation and not model.has_encoder and model.update_weights
    plan = build_launch_plan(deployment)
    assert plan.models[0].router.pd_disaggregation
    assert [(e.kv_role, e.router_role) for e in plan.engines] == [("kv_producer", "prefill")] * 2 + [
        ("kv_consumer", "decode")
    ] * 3


def test_epd_with_prefill_and_decode(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            server_groups:
              - worker_type: encoder
                num_gpus: 1
              - worker_type: prefill
                num_gpus: 1
              - worker_type: decode
                num_gpus: 1
        """,
        gpus=3,
    )  # encoder GPUs count towards --rollout-num-gpus
    (model,) = deployment.models
    assert layout(model) == [("encoder", 1, 1, 1), ("prefill", 1, 1, 1), ("decode", 1, 1, 1)]
    assert model.has_encoder and model.pd_disaggregation
    # update_weights is inferred true here; weight sync into EPD is untested, which is said.
    assert model.update_weights and any("EPD" in w for w in deployment.warnings)
    plan = build_launch_plan(deployment)
    roles = [(e.worker_type, e.ec_role, e.kv_role, e.language_only, e.router_role) for e in plan.engines]
    assert roles == [
        ("encoder", "ec_producer", None, False, None),
        ("prefill", "ec_consumer", "kv_producer", True, "prefill"),
        ("decode", None, "kv_consumer", False, "decode"),
    ]


def test_epd_with_regular(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            update_weights: false
            server_groups:
              - worker_type: encoder
                num_gpus: 2
              - worker_type: regular
                num_gpus: 6
        """,
        gpus=8,
    )
    (model,) = deployment.models
    assert layout(model) == [("encoder", 2, 1, 1), ("regular", 6, 1, 1)]
    assert not model.pd_disaggregation and not model.update_weights and not deployment.warnings
    plan = build_launch_plan(deployment)
    assert [e.ec_role for e in plan.models[0].encoders] == ["ec_producer"] * 2
    assert {(e.ec_role, e.kv_role, e.language_only) for e in plan.models[0].language_engines} == {
        ("ec_consumer", None, True)
    }
    assert not plan.models[0].router.pd_disaggregation
    # The default encoder cache is vime's to remove at the end of the run; a path the user chose is not.
    assert plan.owned_ec_cache and plan.owned_ec_cache.startswith("/dev/shm/vime-ec-")
    assert build_launch_plan(deployment, ec_storage_path="/mnt/shared/ec").owned_ec_cache is None


def test_multi_model(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            update_weights: true              # receives weight updates from training
            server_groups:
              - worker_type: regular
                num_gpus: 8
                num_gpus_per_engine: 4

          - name: ref
            model_path: /path/to/ref_model    # different model checkpoint
            update_weights: false              # frozen, no weight updates
            server_groups:
              - worker_type: regular
                num_gpus: 4
                num_gpus_per_engine: 2

          - name: reward
            model_path: /path/to/reward_model
            update_weights: false
            server_groups:
              - worker_type: regular
                num_gpus: 4
                num_gpus_per_engine: 2
        """,
        hf_checkpoint="/path/to/actor_model",
        gpus=16,
    )
    actor, ref, reward = deployment.models
    assert (actor.model_path, ref.model_path, reward.model_path) == (
        "/path/to/actor_model",
        "/path/to/ref_model",
        "/path/to/reward_model",
    )
    assert [m.update_weights for m in deployment.models] == [True, False, False]
    assert [layout(m) for m in deployment.models] == [
        [("regular", 2, 4, 4)],
        [("regular", 2, 2, 2)],
        [("regular", 2, 2, 2)],
    ]
    assert [m.name for m in deployment.weight_synced_models] == ["actor"]
    plan = build_launch_plan(deployment)
    assert [m.router.model_name for m in plan.models] == ["actor", "ref", "reward"]  # one router per model
    assert [e.index for e in plan.engines] == list(range(6))
    assert [e.model_path for e in plan.model("ref").language_engines] == ["/path/to/ref_model"] * 2


def test_usage_guide_multi_model(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            update_weights: true
            server_groups:
              - worker_type: regular
                num_gpus: 8
                num_gpus_per_engine: 4
          - name: ref
            model_path: /path/to/ref_model
            update_weights: false
            server_groups:
              - worker_type: regular
                num_gpus: 4
                num_gpus_per_engine: 2
        """,
        gpus=12,
    )
    assert [(m.name, m.num_engines, m.update_weights) for m in deployment.models] == [
        ("actor", 2, True),
        ("ref", 2, False),
    ]


def test_multi_model_with_pd(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            update_weights: true
            server_groups:
              - worker_type: prefill
                num_gpus: 4
                num_gpus_per_engine: 2
              - worker_type: decode
                num_gpus: 8
                num_gpus_per_engine: 4
          - name: ref
            model_path: /path/to/ref_model
            update_weights: false
            server_groups:
              - worker_type: regular
                num_gpus: 4
                num_gpus_per_engine: 2
        """,
        gpus=16,
    )
    actor, ref = deployment.models
    assert layout(actor) == [("prefill", 2, 2, 2), ("decode", 2, 4, 4)]
    assert layout(ref) == [("regular", 2, 2, 2)]
    plan = build_launch_plan(deployment)
    assert [m.router.pd_disaggregation for m in plan.models] == [True, False]
    assert {e.kv_role for e in plan.model("ref").engines} == {None}


def test_placeholder_reserves_gpus_without_engines(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            server_groups:
              - worker_type: regular
                num_gpus: 6
                num_gpus_per_engine: 2
              - worker_type: placeholder
                num_gpus: 2                   # reserve 2 GPUs (no engines created)
        """,
        gpus=8,
    )
    (model,) = deployment.models
    assert layout(model) == [("regular", 3, 2, 2), ("placeholder", 0, 1, 0)]
    assert model.num_gpus == 8 and deployment.num_engines == 3
    assert len(build_launch_plan(deployment).engines) == 3


GUIDE_OVERRIDES = """
    vllm:
      - name: actor
        server_groups:
          - worker_type: regular
            num_gpus: 8
            num_gpus_per_engine: 4
            overrides:
              mem_fraction_static: 0.85
              context_length: 32768
              chunked_prefill_size: 4096
              enable_torch_compile: true
    """


def test_per_group_overrides_win_over_vllm_flags(tmp_path):
    deployment = resolve_text(
        tmp_path, GUIDE_OVERRIDES, gpus=8, vllm_args={"mem-fraction-static": "0.5", "max-model-len": "64"}
    )
    (group,) = deployment.models[0].groups
    assert group.num_engines == 2 and group.tensor_parallel_size == 4
    assert group.vllm_args == {
        "mem-fraction-static": "0.85",
        "max-model-len": "64",
        "context-length": "32768",
        "chunked-prefill-size": "4096",
        "enable-torch-compile": None,
    }


def test_sglang_spellings_are_refused_with_vllms_name(tmp_path):
    """The guide's override example uses SGLang's argument names; the installed vLLM check names
    the field path and vLLM's equivalent instead of failing inside the engine."""
    deployment = resolve_text(tmp_path, GUIDE_OVERRIDES, gpus=8)
    table = {"--gpu-memory-utilization": True, "--max-model-len": True}
    with pytest.raises(ConfigError) as error:
        check_overrides_against_vllm(deployment, table)
    assert error.value.message.startswith(
        "vllm[0].server_groups[0].overrides.mem_fraction_static: vLLM has no flag --mem-fraction-static"
    )
    assert "gpu_memory_utilization" in error.value.message
    check_overrides_against_vllm(deployment, {})  # no vLLM installed: nothing to check against
    fine = resolve_text(
        tmp_path,
        """
        vllm:
          - name: a
            server_groups:
              - {worker_type: regular, num_gpus: 1, overrides: {gpu_memory_utilization: 0.5, max-model-len: 64}}
        """,
        gpus=1,
    )
    check_overrides_against_vllm(fine, table)


def test_complete_agentic_example(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: actor
            update_weights: true
            server_groups:
              - worker_type: prefill
                num_gpus: 4
                num_gpus_per_engine: 2
                overrides:
                  chunked_prefill_size: 8192
              - worker_type: decode
                num_gpus: 12
                num_gpus_per_engine: 4
                overrides:
                  mem_fraction_static: 0.88

          - name: ref
            model_path: /data/models/Qwen3-32B
            update_weights: false
            server_groups:
              - worker_type: regular
                num_gpus: 8
                num_gpus_per_engine: 4

          - name: reward
            model_path: /data/models/reward-model
            update_weights: false
            server_groups:
              - worker_type: regular
                num_gpus: 8
                num_gpus_per_engine: 4
        """,
        hf_checkpoint="/data/models/Qwen3-8B",
        gpus=32,
    )
    actor, ref, reward = deployment.models
    assert layout(actor) == [("prefill", 2, 2, 2), ("decode", 3, 4, 4)]
    assert layout(ref) == layout(reward) == [("regular", 2, 4, 4)]
    assert actor.groups[0].vllm_args["chunked-prefill-size"] == "8192"
    assert "chunked-prefill-size" not in actor.groups[1].vllm_args
    assert actor.groups[1].vllm_args["mem-fraction-static"] == "0.88"
    assert (actor.model_path, ref.model_path) == ("/data/models/Qwen3-8B", "/data/models/Qwen3-32B")
    assert deployment.num_gpus == 32 and deployment.num_engines == 9


# ------------------------------------------------------------------------------ the cascade
def test_gpus_per_engine_cascade_group_over_model_over_flag(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: a
            num_gpus_per_engine: 2
            server_groups:
              - {worker_type: regular, num_gpus: 4}
              - {worker_type: regular, num_gpus: 4, num_gpus_per_engine: 4}
          - name: b
            update_weights: false
            server_groups:
              - {worker_type: regular, num_gpus: 3}
        """,
        gpus=11,
        per_engine=3,
    )
    a, b = deployment.models
    assert [g.num_gpus_per_engine for g in a.groups] == [2, 4]
    assert [g.num_gpus_per_engine for g in b.groups] == [3]


def test_model_path_cascade_and_update_weights_inference(tmp_path, actor_dir, caplog, monkeypatch):
    monkeypatch.chdir(os.path.dirname(actor_dir))
    with caplog.at_level(logging.WARNING, logger="vime.config.vllm_config"):
        deployment = resolve_text(
            tmp_path,
            """
            vllm:
              - name: same-by-another-spelling
                model_path: ./actor/
                server_groups:
                  - {worker_type: regular, num_gpus: 1}
              - name: group-override
                server_groups:
                  - {worker_type: regular, num_gpus: 1, overrides: {model_path: /models/other}}
                  - {worker_type: placeholder, num_gpus: 1}
              - name: frozen
                model_path: /models/other
                update_weights: false
                server_groups:
                  - {worker_type: regular, num_gpus: 1}
            """,
            hf_checkpoint=actor_dir,
            gpus=4,
        )
    same, override, frozen = deployment.models
    assert same.model_path == actor_dir and same.update_weights  # ./actor/ is --hf-checkpoint
    assert override.model_path == "/models/other" and not override.update_weights
    assert "model_path" not in override.groups[0].overrides  # vime passes it as --model
    assert not frozen.update_weights and not frozen.update_weights_inferred
    # Only the inferred false is warned about, naming the model.
    assert len(deployment.warnings) == 1 and "vllm[1] (group-override)" in deployment.warnings[0]
    assert "update_weights" in caplog.text and "group-override" in caplog.text


def test_parallel_sizes_divide_the_engine(tmp_path):
    text = """
        vllm:
          - name: a
            server_groups:
              - {worker_type: regular, num_gpus: 8, num_gpus_per_engine: 4, overrides: {data_parallel_size: 2}}
              - {worker_type: regular, num_gpus: 8, num_gpus_per_engine: 8}
        """
    deployment = resolve_text(tmp_path, text, gpus=16, vllm_args={"pipeline-parallel-size": "2"})
    assert [g.tensor_parallel_size for g in deployment.models[0].groups] == [1, 4]
    message = refused(tmp_path, text, gpus=16, vllm_args={"pipeline-parallel-size": "3"})
    assert message.startswith("vllm[0].server_groups[0]: an engine of 4 GPUs cannot be split")


def test_multi_node_engines_span_whole_nodes(tmp_path):
    text = """
        vllm:
          - name: a
            server_groups:
              - {worker_type: regular, num_gpus: 32, num_gpus_per_engine: 16}
        """
    (group,) = resolve_text(tmp_path, text, gpus=32, gpus_per_node=8).models[0].groups
    assert (group.num_engines, group.nodes_per_engine, group.tensor_parallel_size) == (2, 2, 16)
    message = refused(tmp_path, text.replace("16}", "12}").replace("32", "36"), gpus=36, gpus_per_node=8)
    assert message.startswith("vllm[0].server_groups[0]: an engine of 12 GPUs")
    message = refused(tmp_path, text.replace("32", "24"), gpus=24, gpus_per_node=8)
    assert (
        message == "vllm[0].server_groups[0].num_gpus 24 is not a multiple of num_gpus_per_engine 16 "
        "(from vllm[0].server_groups[0].num_gpus_per_engine)"
    )


def test_engine_groups_alias(tmp_path):
    deployment = resolve_text(
        tmp_path,
        """
        vllm:
          - name: a
            engine_groups:
              - {worker_type: regular, num_gpus: 2}
        """,
        gpus=2,
    )
    assert layout(deployment.models[0]) == [("regular", 2, 1, 1)]
    message = refused(
        tmp_path,
        """
        vllm:
          - name: a
            engine_groups: [{worker_type: regular, num_gpus: 1}]
            server_groups: [{worker_type: regular, num_gpus: 1}]
        """,
        gpus=1,
    )
    assert message.startswith("vllm[0] gives both server_groups and engine_groups")


# ---------------------------------------------------------------------------- invalid cases
ONE_GOOD_MODEL = """
    vllm:
      - name: actor
        server_groups:
          - {worker_type: regular, num_gpus: 2}
"""


@pytest.mark.parametrize(
    "second, expected",
    [
        (
            "{name: b, server_groups: [{worker_type: regular, num_gpus: 0}]}",
            "vllm[1].server_groups[0].num_gpus must be > 0",
        ),
        (
            "{name: b, server_groups: [{worker_type: regular, num_gpus: -2}]}",
            "vllm[1].server_groups[0].num_gpus must be > 0",
        ),
        (
            "{name: b, server_groups: [{worker_type: regular, num_gpus: 2, num_gpus_per_engine: 0}]}",
            "vllm[1].server_groups[0].num_gpus_per_engine must be > 0",
        ),
        (
            "{name: b, num_gpus_per_engine: 0, server_groups: [{worker_type: regular, num_gpus: 2}]}",
            "vllm[1].num_gpus_per_engine must be > 0",
        ),
        ("{name: b, server_groups: [{worker_type: regular}]}", "vllm[1].server_groups[0].num_gpus is required"),
        ("{name: b, server_groups: [{num_gpus: 2}]}", "vllm[1].server_groups[0].worker_type is required"),
        ("{server_groups: [{worker_type: regular, num_gpus: 2}]}", "vllm[1].name is required"),
        ("{name: b}", "vllm[1].server_groups is required"),
        ("{name: b, server_groups: []}", "vllm[1].server_groups must list at least one group"),
        (
            "{name: b, server_groups: [{worker_type: mixed, num_gpus: 2}]}",
            "vllm[1].server_groups[0].worker_type must be one of regular, prefill, decode, encoder, placeholder "
            "(got 'mixed')",
        ),
        (
            "{name: b, server_groups: [{worker_type: regular, num_gpus: two}]}",
            "vllm[1].server_groups[0].num_gpus must be an integer, got a string",
        ),
        (
            "{name: b, update_weights: maybe, server_groups: [{worker_type: regular, num_gpus: 2}]}",
            "vllm[1].update_weights must be true or false, got a string",
        ),
        (
            "{name: b, server_groups: [{worker_type: regular, num_gpus: 2, overrides: null}]}",
            "vllm[1].server_groups[0].overrides must be a mapping, got empty (null)",
        ),
        (
            "{name: actor, server_groups: [{worker_type: regular, num_gpus: 2}]}",
            "vllm[1].name 'actor' is already used by vllm[0]; names must be unique",
        ),
        ("{name: 'b c', server_groups: [{worker_type: regular, num_gpus: 2}]}", "vllm[1].name 'b c' must start"),
        (
            "{name: b, model_path: '', server_groups: [{worker_type: regular, num_gpus: 2}]}",
            "vllm[1].model_path must not be empty",
        ),
    ],
)
def test_schema_errors_name_the_field_path(tmp_path, second, expected):
    message = refused(tmp_path, ONE_GOOD_MODEL + f"      - {second}\n", gpus=4)
    assert message.startswith(expected), message


def test_unknown_fields_are_named_with_a_suggestion(tmp_path):
    message = refused(
        tmp_path,
        """
        vllm:
          - name: a
            server_groups:
              - {worker_type: regular, num_gpu: 2}
        """,
        gpus=2,
    )
    assert message.startswith("vllm[0].server_groups[0].num_gpu is not a known field (did you mean 'num_gpus'?)")
    message = refused(
        tmp_path,
        """
        vllm:
          - name: a
            update_weight: true
            server_groups: [{worker_type: regular, num_gpus: 2}]
        """,
        gpus=2,
    )
    assert message.startswith("vllm[0].update_weight is not a known field (did you mean 'update_weights'?)")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", "vllm is required: the file holds no YAML document"),
        ("- a\n- b\n", "the file must hold a mapping with a top-level 'vllm' list"),
        ("models: []\n", "models is not a known field"),
        ("vllm: []\n", "vllm must list at least one model"),
        ("vllm: {name: a}\n", "vllm must be a list, got a mapping"),
        ("vllm: [: bad\n", "is not valid YAML"),
    ],
)
def test_document_level_errors(tmp_path, text, expected):
    assert expected in refused(tmp_path, text, gpus=1)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="^--vllm-config: .*nope.yaml' does not exist"):
        load_vllm_config(tmp_path / "nope.yaml")


def test_total_gpus_must_equal_rollout_num_gpus(tmp_path):
    message = refused(
        tmp_path,
        ONE_GOOD_MODEL
        + """
      - name: ref
        model_path: /r
        update_weights: false
        server_groups: [{worker_type: encoder, num_gpus: 1}, {worker_type: regular, num_gpus: 1}]
""",
        gpus=3,
    )
    assert message.startswith("the server groups use 4 GPUs in all (actor 2 + ref 2), but --rollout-num-gpus is 3")


@pytest.mark.parametrize(
    "groups, expected",
    [
        (
            "[{worker_type: regular, num_gpus: 2}, {worker_type: prefill, num_gpus: 1}, "
            "{worker_type: decode, num_gpus: 1}]",
            "vllm[0].server_groups mixes regular with prefill/decode groups",
        ),
        (
            "[{worker_type: regular, num_gpus: 2}, {worker_type: decode, num_gpus: 2}]",
            "vllm[0].server_groups mixes regular with prefill/decode groups",
        ),
        ("[{worker_type: prefill, num_gpus: 4}]", "vllm[0].server_groups has prefill groups but no decode group"),
        (
            "[{worker_type: encoder, num_gpus: 2}, {worker_type: decode, num_gpus: 2}]",
            "vllm[0].server_groups has decode groups but no prefill group",
        ),
        (
            "[{worker_type: encoder, num_gpus: 2}, {worker_type: placeholder, num_gpus: 2}]",
            "vllm[0].server_groups has encoder groups but no prefill or regular group",
        ),
    ],
)
def test_pd_rule(tmp_path, groups, expected):
    message = refused(tmp_path, f"vllm:\n  - name: a\n    server_groups: {groups}\n", gpus=4)
    assert message.startswith(expected), message


def test_encoder_is_orthogonal_to_pd(tmp_path):
    for groups in (
        "[{worker_type: encoder, num_gpus: 1}, {worker_type: regular, num_gpus: 3}]",
        "[{worker_type: encoder, num_gpus: 1}, {worker_type: prefill, num_gpus: 1}, "
        "{worker_type: decode, num_gpus: 1}, {worker_type: placeholder, num_gpus: 1}]",
    ):
        resolve_text(tmp_path, f"vllm:\n  - name: a\n    server_groups: {groups}\n", gpus=4)


def test_groups_of_a_model_share_one_model_path(tmp_path):
    message = refused(
        tmp_path,
        """
        vllm:
          - name: a
            model_path: /models/a
            server_groups:
              - {worker_type: prefill, num_gpus: 1}
              - {worker_type: decode, num_gpus: 1, overrides: {model_path: /models/b}}
        """,
        gpus=2,
    )
    assert message.startswith(
        "vllm[0].server_groups[1].overrides.model_path '/models/b' differs from vllm[0].model_path '/models/a'"
    )


def test_num_gpus_must_divide_into_engines(tmp_path):
    message = refused(
        tmp_path,
        """
        vllm:
          - name: a
            server_groups:
              - {worker_type: regular, num_gpus: 6, num_gpus_per_engine: 4}
        """,
        gpus=6,
    )
    assert message.startswith("vllm[0].server_groups[0].num_gpus 6 is not a multiple of num_gpus_per_engine 4")
    message = refused(
        tmp_path,
        """
        vllm:
          - name: a
            server_groups:
              - {worker_type: regular, num_gpus: 3}
        """,
        gpus=3,
        per_engine=2,
    )
    assert message.endswith("(from --rollout-num-gpus-per-engine)")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            "{tensor_parallel_size: 2}",
            "vllm[0].server_groups[0].overrides.tensor_parallel_size is set by vime; use num_gpus_per_engine",
        ),
        ("{model: /x}", "vllm[0].server_groups[0].overrides.model is set by vime; use model_path"),
        ("{port: 1}", "vllm[0].server_groups[0].overrides.port is set by vime"),
        ("{max_model_len: 1, max-model-len: 2}", "vllm[0].server_groups[0].overrides gives max_model_len twice"),
        ("{model_path: 3}", "vllm[0].server_groups[0].overrides.model_path must be a non-empty string"),
        ("{kv_transfer_config: [1]}", "vllm[0].server_groups[0].overrides.kv_transfer_config must be a mapping"),
        ("{ec_transfer_config: '{oops'}", "vllm[0].server_groups[0].overrides.ec_transfer_config is not valid JSON"),
    ],
)
def test_bad_overrides(tmp_path, overrides, expected):
    message = refused(
        tmp_path,
        f"""
        vllm:
          - name: a
            server_groups:
              - {{worker_type: regular, num_gpus: 1, overrides: {overrides}}}
        """,
        gpus=1,
    )
    assert message.startswith(expected), message


# ---------------------------------------------------------------- without --vllm-config
def test_default_deployment_and_legacy_prefill_num_servers():
    flags = GlobalFlags(hf_checkpoint="/m", rollout_num_gpus=8, rollout_num_gpus_per_engine=2)
    (model,) = default_deployment(flags).models
    assert (model.name, model.update_weights, layout(model)) == ("default", True, [("regular", 4, 2, 2)])
    legacy = default_deployment(flags, prefill_num_servers=1)
    assert legacy.origin == "prefill-num-servers"
    assert layout(legacy.models[0]) == [("prefill", 1, 2, 2), ("decode", 3, 2, 2)]
    with pytest.raises(ConfigError, match="^--prefill-num-servers: 4 prefill engine"):
        default_deployment(flags, prefill_num_servers=4)
    router_only = default_deployment(GlobalFlags(hf_checkpoint="/m", rollout_num_gpus=0))
    assert router_only.models[0].groups == () and len(build_launch_plan(router_only).models) == 1


# ---------------------------------------------------- through the command line (validate())


PD_YAML = """
    vllm:
      - name: actor
        server_groups:
          - {worker_type: prefill, num_gpus: 1}
          - {worker_type: decode, num_gpus: 1}
      - name: ref
        model_path: /models/ref
        update_weights: false
        server_groups:
          - {worker_type: regular, num_gpus: 2}
"""


def test_command_line_resolves_the_topology(tmp_path, actor_dir):
    s = parse_train_args(cli(actor_dir, "--vllm-config", write(tmp_path, PD_YAML), "--rollout-num-gpus", "4"))
    deployment = s.args.vllm_deployment
    assert [(m.name, m.update_weights, m.num_engines) for m in deployment.models] == [
        ("actor", True, 2),
        ("ref", False, 2),
    ]
    default = parse_train_args(cli(actor_dir, "--rollout-num-gpus", "2"))
    assert default.args.vllm_deployment.origin == "default"
    legacy = parse_train_args(cli(actor_dir, "--rollout-num-gpus", "3", "--prefill-num-servers", "1"))
    assert layout(legacy.args.vllm_deployment.models[0]) == [("prefill", 1, 1, 1), ("decode", 2, 1, 1)]
    external = parse_train_args(cli(actor_dir, "--rollout-external-engine-addrs", "host1:10090", "host2:10091"))
    assert external.args.vllm_deployment is None
    assert external.args.rollout_external_engine_addrs == ["host1:10090", "host2:10091"]


def test_num_gpus_per_node_divides_large_engines_into_nodes(actor_dir):
    s = parse_train_args(
        cli(actor_dir, "--rollout-num-gpus", "16", "--rollout-num-gpus-per-engine", "16", "--num-gpus-per-node", "8")
    )
    (group,) = s.args.vllm_deployment.models[0].groups
    assert (group.num_engines, group.nodes_per_engine, group.tensor_parallel_size) == (1, 2, 16)
    with pytest.raises(ConfigError, match="^--rollout-num-gpus-per-engine: .*must span whole nodes"):
        parse_train_args(
            cli(
                actor_dir, "--rollout-num-gpus", "12", "--rollout-num-gpus-per-engine", "12", "--num-gpus-per-node", "8"
            )
        )
    with pytest.raises(ConfigError, match="^--num-gpus-per-node: must be >= 1"):
        parse_train_args(cli(actor_dir, "--num-gpus-per-node", "0"))


@pytest.mark.parametrize(
    "extra, flag, expected",
    [
        (["--prefill-num-servers", "1"], "--vllm-config", "cannot be combined with --prefill-num-servers"),
        (
            ["--rollout-external-engine-addrs", "h:1"],
            "--vllm-config",
            "cannot be combined with --rollout-external-engine-addrs",
        ),
        (["--vllm-router-ip", "10.0.0.1"], "--vllm-router-ip", "one external router cannot serve the 2 models"),
    ],
)
def test_command_line_conflicts(tmp_path, actor_dir, extra, flag, expected):
    argv = cli(actor_dir, "--vllm-config", write(tmp_path, PD_YAML), "--rollout-num-gpus", "4", *extra)
    with pytest.raises(ConfigError) as error:
        parse_train_args(argv)
    assert error.value.flag == flag and error.value.message.startswith(expected), str(error.value)


def test_command_line_gpu_total_uses_the_effective_rollout_gpus(tmp_path, actor_dir):
    with pytest.raises(ConfigError, match=r"use 4 GPUs in all .* --rollout-num-gpus is 1;"):
        parse_train_args(cli(actor_dir, "--vllm-config", write(tmp_path, PD_YAML)))


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--rollout-external-engine-addrs", "host-without-port"], "--rollout-external-engine-addrs"),
        (["--rollout-external-engine-addrs", "h:70000"], "--rollout-external-engine-addrs"),
        (["--prefill-num-servers", "0", "--rollout-num-gpus", "2"], "--prefill-num-servers"),
        (["--prefill-num-servers", "2", "--rollout-num-gpus", "2"], "--prefill-num-servers"),
        (["--prefill-num-servers", "1", "--rollout-external-engine-addrs", "h:1"], "--prefill-num-servers"),
        (["--vllm-data-parallel-size", "2"], "--rollout-num-gpus-per-engine"),
    ],
)
def test_topology_flag_errors(actor_dir, extra, flag):
    with pytest.raises(ConfigError) as error:
        parse_train_args(cli(actor_dir, *extra))
    assert error.value.flag == flag, str(error.value)


# --------------------------------------------------------------------- runtime helpers
def test_get_model_url():
    args = types.SimpleNamespace(vllm_model_routers={"actor": ("10.0.0.1", 30000), "reward": "http://r:1/"})
    assert get_model_url(args, "actor") == "http://10.0.0.1:30000/inference/v1/generate"
    assert get_model_url(args, "reward", "/v1/chat/completions") == "http://r:1/v1/chat/completions"
    with pytest.raises(ValueError, match="no model named 'ref'; served models: actor, reward"):
        get_model_url(args, "ref")
    with pytest.raises(RuntimeError, match="have not started"):
        get_model_url(types.SimpleNamespace(), "actor")


MESSAGES = [
    {"role": "system", "content": "be brief"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "http://img/1.png"}},
            {"type": "image_url", "image_url": {"url": "http://img/2.png"}},
        ],
    },
]


class FakeResponse:
    def __init__(self, status):
        self.status = status

    async def text(self):
        return "boom"

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


class FakeSession:
    def __init__(self, status=200):
        self.status, self.posts = status, []

    def post(self, url, json, timeout):
        self.posts.append((url, json))
        return FakeResponse(self.status)


def test_prime_encoder_sends_each_image_to_an_encoder():
    args = types.SimpleNamespace(vllm_model_encoder_endpoints={"actor": ("/models/vl", ["http://enc:1"])})
    session = FakeSession()
    assert asyncio.run(prime_encoder(args, MESSAGES, model_name="actor", session=session)) == 2
    assert [url for url, _ in session.posts] == ["http://enc:1/v1/chat/completions"] * 2
    bodies = [body for _, body in session.posts]
    assert [b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies] == [
        "http://img/1.png",
        "http://img/2.png",
    ]
    assert all(b["model"] == "/models/vl" and b["max_tokens"] == 1 for b in bodies)


def test_prime_encoder_is_a_no_op_without_images_or_encoders():
    args = types.SimpleNamespace(vllm_model_encoder_endpoints={"actor": ("/models/vl", ["http://enc:1"])})
    session = FakeSession()
    text_only = [{"role": "user", "content": "hi"}]
    assert asyncio.run(prime_encoder(args, text_only, model_name="actor", session=session)) == 0
    assert asyncio.run(prime_encoder(types.SimpleNamespace(), MESSAGES, model_name="actor", session=session)) == 0
    assert asyncio.run(prime_encoder(args, MESSAGES, model_name="ref", session=session)) == 0
    assert session.posts == []
    assert asyncio.run(prime_encoder(args, MESSAGES, session=session)) == 2  # the one model with encoders


def test_prime_encoder_failure_names_the_encoder():
    from vime.engines.http import EngineError

    args = types.SimpleNamespace(vllm_model_encoder_endpoints={"actor": ("/m", ["http://enc:1"])})
    with pytest.raises(EngineError, match="http://enc:1: encoder priming answered 500"):
        asyncio.run(prime_encoder(args, MESSAGES, model_name="actor", session=FakeSession(status=500)))


def test_media_parts_ignores_text():
    assert [p["type"] for p in media_parts(MESSAGES)] == ["image_url", "image_url"]
    assert media_parts([{"role": "user", "content": [{"type": "text", "text": "x"}]}]) == []
    assert media_parts(None) == []
