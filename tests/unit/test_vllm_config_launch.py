"""The launch plan of a resolved --vllm-config: the vLLM command line each engine would get (roles,
kv/ec transfer configs), the start order and the routers. Nothing is started."""

import argparse
import json

import pytest

from vime.config import ConfigError
from vime.config.vllm_config import parse_vllm_config
from vime.config.vllm_deployment import GlobalFlags, resolve
from vime.config.vllm_launch import build_launch_plan
from vime.engines.vllm_server import build_vllm_command

EC_PATH = "/dev/shm/vime-ec-test"


def plan_for(doc, *, gpus, vllm_args=None, router_args=None, external_router_url=None, ec_storage_path=EC_PATH):
    deployment = resolve(
        parse_vllm_config(doc),
        GlobalFlags(hf_checkpoint="/models/vl", rollout_num_gpus=gpus, vllm_args=vllm_args or {}),
    )
    return build_launch_plan(
        deployment, router_args=router_args, external_router_url=external_router_url, ec_storage_path=ec_storage_path
    )


def model(name, *groups, **fields):
    return {"name": name, "server_groups": list(groups), **fields}


def group(worker_type, num_gpus=1, **fields):
    return {"worker_type": worker_type, "num_gpus": num_gpus, **fields}


def argv_of(engine):
    """The exact argv VllmServer would run for this engine."""
    return build_vllm_command(engine.model_path, 8000, "127.0.0.1", engine.vllm_args, engine.tensor_parallel_size)


def flag_value(argv, flag):
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def json_flag(argv, flag):
    return json.loads(flag_value(argv, flag))


def test_pd_engines_get_kv_roles_on_their_command_line():
    plan = plan_for(
        {
            "vllm": [
                model("actor", group("prefill", 4, num_gpus_per_engine=2), group("decode", 4, num_gpus_per_engine=4))
            ]
        },
        gpus=8,
        vllm_args={"max-model-len": "2048", "enforce-eager": None},
    )
    prefill_a, prefill_b, decode = plan.engines
    for engine, role, tp in (
        (prefill_a, "kv_producer", "2"),
        (prefill_b, "kv_producer", "2"),
        (decode, "kv_consumer", "4"),
    ):
        argv = argv_of(engine)
        assert json_flag(argv, "--kv-transfer-config") == {"kv_connector": "NixlConnector", "kv_role": role}
        assert flag_value(argv, "--tensor-parallel-size") == tp
        assert flag_value(argv, "--model") == "/models/vl"
        assert flag_value(argv, "--max-model-len") == "2048" and "--enforce-eager" in argv
        assert "--ec-transfer-config" not in argv  # no encoder in this model
    assert [e.name for e in plan.engines] == ["actor-g0-prefill-0", "actor-g0-prefill-1", "actor-g1-decode-0"]
    router = plan.models[0].router
    assert router.pd_disaggregation
    assert router.router_args == {"vllm-pd-disaggregation": None, "kv-connector": "nixl"}


def test_full_epd_roles_start_order_and_encoder_urls():
    plan = plan_for(
        {"vllm": [model("actor", group("decode"), group("prefill"), group("encoder"), update_weights=False)]}, gpus=3
    )
    (encoder,) = plan.encoders
    assert encoder.index == 0 and [e.index for e in plan.language_engines] == [1, 2]  # encoders start first
    assert (encoder.router_role, encoder.update_weights) == (None, False)  # never registered with the router
    enc_argv = argv_of(encoder)
    assert json_flag(enc_argv, "--ec-transfer-config") == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": EC_PATH},
    }
    assert "--no-enable-prefix-caching" in enc_argv and "--kv-transfer-config" not in enc_argv

    decode, prefill = plan.language_engines
    pre_argv, dec_argv = argv_of(prefill), argv_of(decode)
    assert json_flag(pre_argv, "--ec-transfer-config") == {
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": EC_PATH},
    }
    assert json_flag(pre_argv, "--kv-transfer-config")["kv_role"] == "kv_producer"
    assert "--no-enable-prefix-caching" not in pre_argv
    assert "--ec-transfer-config" not in dec_argv  # decode never touches the encoder cache
    assert json_flag(dec_argv, "--kv-transfer-config")["kv_role"] == "kv_consumer"
    assert (prefill.language_only, decode.language_only) == (True, False)

    # The encoders' URLs go to the language-only engines once the encoders run.
    wired = plan.with_encoder_urls({"actor": ["http://10.0.0.5:9000"]})
    decode, prefill = wired.language_engines
    assert prefill.encoder_urls == ("http://10.0.0.5:9000",) and decode.encoder_urls == ()
    assert wired.encoder_endpoints({"actor": ["http://10.0.0.5:9000"]}) == {
        "actor": ("/models/vl", ["http://10.0.0.5:9000"])
    }
    with pytest.raises(ValueError, match="1 encoder engine"):
        plan.models[0].with_encoder_urls([])


def test_encoder_endpoints_carry_the_encoders_served_name():
    plan = plan_for(
        {
            "vllm": [
                model(
                    "vl",
                    group("encoder", overrides={"served_model_name": "vl-enc vl"}),
                    group("regular"),
                    update_weights=False,
                )
            ]
        },
        gpus=2,
    )
    assert plan.encoder_endpoints({"vl": ["http://e:1"]}) == {"vl": ("vl-enc", ["http://e:1"])}
    assert "--served-model-name" in argv_of(plan.encoders[0])


def test_encoder_with_regular_split_without_pd():
    plan = plan_for(
        {"vllm": [model("actor", group("encoder", 2), group("regular", 6, num_gpus_per_engine=2))]},
        gpus=8,
        vllm_args={"enable-prefix-caching": None},
    )
    assert len(plan.encoders) == 2 and len(plan.language_engines) == 3
    for engine in plan.encoders:
        argv = argv_of(engine)
        assert "--enable-prefix-caching" not in argv and "--no-enable-prefix-caching" in argv  # forced off
    for engine in plan.language_engines:
        argv = argv_of(engine)
        assert json_flag(argv, "--ec-transfer-config")["ec_role"] == "ec_consumer"
        assert "--kv-transfer-config" not in argv and "--enable-prefix-caching" in argv
        assert engine.router_role == "regular" and engine.language_only
    assert not plan.models[0].router.pd_disaggregation and plan.models[0].router.router_args == {}


def test_user_ec_transfer_config_replaces_the_generated_one_per_group():
    """The guide's connector swap: the user's keys win over the derived connector/role, nothing is
    deep-merged, and a group without the override keeps the generated config."""
    custom = {
        "ec_connector": "MyProductionConnector",
        "ec_connector_extra_config": {"shared_storage_path": "/mnt/shared/ec-cache"},
    }
    plan = plan_for(
        {
            "vllm": [
                model(
                    "actor",
                    group("encoder", overrides={"ec_transfer_config": custom}),
                    group("regular", overrides={"ec_transfer_config": json.dumps(custom)}),
                    group("regular"),
                )
            ]
        },
        gpus=3,
    )
    encoder, consumer, plain = plan.engines
    assert json_flag(argv_of(encoder), "--ec-transfer-config") == {
        "ec_connector": "MyProductionConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": "/mnt/shared/ec-cache"},
    }
    assert json_flag(argv_of(consumer), "--ec-transfer-config") == {
        "ec_connector": "MyProductionConnector",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"shared_storage_path": "/mnt/shared/ec-cache"},
    }
    assert json_flag(argv_of(plain), "--ec-transfer-config")["ec_connector_extra_config"] == {
        "shared_storage_path": EC_PATH
    }


def test_user_kv_transfer_config_is_layered_over_the_roles():
    overrides = {"kv_transfer_config": {"kv_connector": "MooncakeConnector", "kv_buffer_size": 1e9}}
    plan = plan_for(
        {"vllm": [model("actor", group("prefill", overrides=overrides), group("decode", overrides=overrides))]}, gpus=2
    )
    prefill, decode = plan.engines
    assert json_flag(argv_of(prefill), "--kv-transfer-config") == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer",
        "kv_buffer_size": 1e9,
    }
    assert json_flag(argv_of(decode), "--kv-transfer-config")["kv_role"] == "kv_consumer"
    assert plan.models[0].router.router_args["kv-connector"] == "mooncake"  # router speaks the same protocol

    # A --vllm-kv-transfer-config flag is the user's layer for groups that do not override it.
    plan = plan_for(
        {"vllm": [model("actor", group("prefill"), group("decode"))]},
        gpus=2,
        vllm_args={"kv-transfer-config": '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'},
    )
    assert {json_flag(argv_of(e), "--kv-transfer-config")["kv_role"] for e in plan.engines} == {"kv_both"}


def test_one_model_cannot_mix_kv_connectors():
    with pytest.raises(ConfigError, match="model actor uses several KV connectors"):
        plan_for(
            {
                "vllm": [
                    model(
                        "actor",
                        group("prefill", overrides={"kv_transfer_config": {"kv_connector": "MooncakeConnector"}}),
                        group("decode"),
                    )
                ]
            },
            gpus=2,
        )


def test_overrides_become_command_line_flags():
    plan = plan_for(
        {
            "vllm": [
                model(
                    "actor",
                    group(
                        "regular",
                        overrides={
                            "enable_prefix_caching": False,
                            "enforce_eager": None,
                            "max-num-seqs": 8,
                            "limit_mm_per_prompt": {"image": 2},
                            "gpu_memory_utilization": 0.5,
                        },
                    ),
                )
            ]
        },
        gpus=1,
        vllm_args={"enable-prefix-caching": None, "enforce-eager": None, "dtype": "float32"},
    )
    argv = argv_of(plan.engines[0])
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--enforce-eager" not in argv  # null drops a flag inherited from --vllm-*
    assert flag_value(argv, "--max-num-seqs") == "8" and flag_value(argv, "--dtype") == "float32"
    assert json_flag(argv, "--limit-mm-per-prompt") == {"image": 2}
    assert flag_value(argv, "--gpu-memory-utilization") == "0.5"


def test_routers_one_per_model_and_external_router_only_for_one_model():
    doc = {
        "vllm": [
            model("actor", group("regular", 2)),
            model("ref", group("regular", 2), model_path="/models/ref", update_weights=False),
        ]
    }
    plan = plan_for(doc, gpus=4, router_args={"policy": "consistent_hash"})
    assert [(m.name, m.router.router_args, m.router.external_url) for m in plan.models] == [
        ("actor", {"policy": "consistent_hash"}, None),
        ("ref", {"policy": "consistent_hash"}, None),
    ]
    assert [(e.name, e.index, e.update_weights) for e in plan.engines] == [
        ("actor-g0-regular-0", 0, True),
        ("actor-g0-regular-1", 1, True),
        ("ref-g0-regular-0", 2, False),
        ("ref-g0-regular-1", 3, False),
    ]
    with pytest.raises(ConfigError, match="^--vllm-router-ip: one external router cannot serve 2 models"):
        plan_for(doc, gpus=4, external_router_url="http://10.0.0.1:30000")
    single = plan_for(
        {"vllm": [model("actor", group("regular", 2))]}, gpus=2, external_router_url="http://10.0.0.1:30000"
    )
    assert single.models[0].router.external_url == "http://10.0.0.1:30000"


def test_ec_storage_path_is_per_deployment_and_only_with_encoders():
    doc = {"vllm": [model("actor", group("encoder"), group("regular"))]}
    first = plan_for(doc, gpus=2, ec_storage_path=None).ec_storage_path
    second = plan_for(doc, gpus=2, ec_storage_path=None).ec_storage_path
    assert first.startswith("/dev/shm/vime-ec-") and first != second
    assert plan_for({"vllm": [model("actor", group("regular"))]}, gpus=1, ec_storage_path=None).ec_storage_path is None


def test_multi_node_engine_reports_its_nodes():
    deployment = resolve(
        parse_vllm_config({"vllm": [model("big", group("regular", 16, num_gpus_per_engine=16))]}),
        GlobalFlags(hf_checkpoint="/m", rollout_num_gpus=16, gpus_per_node=8),
    )
    (engine,) = build_launch_plan(deployment).engines
    assert (engine.num_gpus, engine.num_nodes, engine.tensor_parallel_size) == (16, 2, 16)


def test_encoders_of_every_model_start_before_any_language_engine():
    plan = plan_for(
        {
            "vllm": [
                model("actor", group("encoder"), group("regular")),
                model("judge", group("regular"), group("encoder"), update_weights=False),
            ]
        },
        gpus=4,
    )
    assert [(e.name, e.index) for e in plan.engines] == [
        ("actor-g0-encoder-0", 0),
        ("judge-g1-encoder-0", 1),
        ("actor-g1-regular-0", 2),
        ("judge-g0-regular-0", 3),
    ]
    assert [e.name for e in plan.model("judge").encoders] == ["judge-g1-encoder-0"]


def deployment_for(doc, gpus):
    return resolve(parse_vllm_config(doc), GlobalFlags(hf_checkpoint="/models/vl", rollout_num_gpus=gpus))


def test_the_trained_model_is_the_one_weight_synced_model():
    from vime.config.vllm_deployment import trained_model_name

    doc = {
        "vllm": [
            model("ref", group("regular"), model_path="/models/ref", update_weights=False),
            model("actor", group("regular"), update_weights=True),
        ]
    }
    assert trained_model_name(deployment_for(doc, 2)) == "actor"
    both = {"vllm": [model("a", group("regular")), model("b", group("regular"))]}  # both inferred from the path
    with pytest.raises(ConfigError, match=r"--vllm-config.*exactly one model .*found 2 \(a, b\)"):
        trained_model_name(deployment_for(both, 2))
    none = {"vllm": [model("ref", group("regular"), update_weights=False)]}
    with pytest.raises(ConfigError, match=r"found 0 \(none\)"):
        trained_model_name(deployment_for(none, 1))


def test_engine_variants_carry_each_groups_flags_and_size():
    """What the driver hands the engine manager per engine: the group's overrides and TP size,
    plus the weight transport's additions."""
    from vime.workers.model_servers import engine_variants

    plan = plan_for(
        {
            "vllm": [
                model(
                    "actor",
                    group("regular", 2, num_gpus_per_engine=2, overrides={"max_model_len": 128}),
                    group("regular", 1),
                )
            ]
        },
        gpus=3,
        vllm_args={"max-model-len": "64"},
    )
    variants = engine_variants(plan.model("actor").language_engines, lambda args: {**args, "extra": "1"})
    assert [(v.tensor_parallel_size, v.vllm_args["max-model-len"], v.vllm_args["extra"]) for v in variants] == [
        (2, "128", "1"),
        (1, "64", "1"),
    ]


def test_a_pd_router_lists_every_prefill_and_decode_engine_on_its_command_line():
    """vllm-router learns PD engines from --prefill / --decode (repeated), once they serve."""
    from types import SimpleNamespace

    from vime.engines.router import build_router_command
    from vime.workers.model_servers import pd_router_args

    plan = plan_for(
        {"vllm": [model("actor", group("prefill", 2), group("decode", 1))]},
        gpus=3,
        router_args={"policy": "round_robin"},
    )
    members = [
        SimpleNamespace(url=f"http://h:{port}", worker_type=kind, state=state)
        for port, kind, state in (
            (1, "prefill", "serving"),
            (2, "prefill", "serving"),
            (3, "decode", "serving"),
            (4, "decode", "lost"),
        )
    ]
    args = pd_router_args(plan.model("actor"), SimpleNamespace(members=members))
    argv = build_router_command("127.0.0.1", 9000, args)
    assert argv[argv.index("--policy") + 1] == "round_robin" and "--vllm-pd-disaggregation" in argv
    assert argv[argv.index("--kv-connector") + 1] == "nixl"
    pairs = [(argv[i], argv[i + 1]) for i, a in enumerate(argv) if a in ("--prefill", "--decode")]
    assert pairs == [("--prefill", "http://h:1"), ("--prefill", "http://h:2"), ("--decode", "http://h:3")]


def test_engine_variants_carry_the_role_and_restarts_keep_a_pd_engines_port(monkeypatch, tmp_path):
    from vime.workers import engines
    from vime.workers.engine_members import EngineTemplate
    from vime.workers.model_servers import engine_variants

    plan = plan_for({"vllm": [model("actor", group("prefill", 1), group("decode", 1))]}, gpus=2)
    variants = engine_variants(plan.model("actor").engines, dict)
    template = EngineTemplate(
        model="/m",
        vllm_args={},
        tensor_parallel_size=1,
        run_token="t",
        log_dir=str(tmp_path),
        startup_timeout=1,
        http_timeout=1,
        weight_dir=str(tmp_path),
    )
    specs = [template.spec(i, variant=v) for i, v in enumerate(variants)]
    assert [(s.worker_type, s.keep_port) for s in specs] == [("prefill", True), ("decode", True)]
    assert not template.spec(2).keep_port  # a regular engine re-registers wherever it listens

    ports = []

    class FakeServer:
        def __init__(self, model, *, port=None, **_):
            self.port = port if port is not None else 40000 + len(ports)
            self.url = f"http://127.0.0.1:{self.port}"
            ports.append(self.port)

        def start(self):
            return self

        def wait_healthy(self, timeout):
            pass

    monkeypatch.setattr(engines, "VllmServer", FakeServer)
    actor = engines.EngineActor(specs[0])
    actor._start_server()
    actor.restarts = 1
    actor._start_server()  # a restart: the same port, where the PD router expects it
    assert ports == [40000, 40000]


def test_every_served_models_router_is_published_as_ip_and_port():
    """args.vllm_model_routers[name] is (ip, port) for the trained model and the frozen ones alike
    (docs/vllm-config.md); an IPv6 host loses its URL brackets, which get_model_url puts back."""
    from vime.rollout.model_routes import get_model_url
    from vime.workers.model_servers import ModelServer

    class NoEngines:
        router = None

    server = ModelServer(
        "actor",
        NoEngines(),
        launch=None,
        frozen=False,
        log_dir="logs",
        run_token="token",
        http_timeout=1.0,
        router_restart_budget=0,
        say=print,
        record=print,
    )
    server.router_url = "http://127.0.0.1:30000"
    assert server.address == ("127.0.0.1", 30000)
    server.router_url = "http://[::1]:8000"
    assert server.address == ("::1", 8000)
    args = argparse.Namespace(vllm_model_routers={"actor": server.address})
    assert get_model_url(args, "actor") == "http://[::1]:8000/inference/v1/generate"
