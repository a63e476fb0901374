"""``--vllm-config`` launch plan: a :class:`~vime.config.vllm_deployment.Deployment` turned into the vLLM
arguments, roles and start order of every engine and the router of every model (nothing is started here).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from vime.config.base import ConfigError
from vime.config.vllm_config import FLAG, RouterRole, WorkerType, fail, transfer_mapping
from vime.config.vllm_deployment import Deployment, ResolvedGroup, ResolvedModel

# Upstream vLLM's reference encoder-cache connector (file-backed) and the KV connector that
# vllm-router's PD mode speaks by default.
DEFAULT_EC_CONNECTOR = "ECExampleConnector"
DEFAULT_KV_CONNECTOR = "NixlConnector"
# vllm-router's --kv-connector names for vLLM's KV connector classes.
_ROUTER_KV_CONNECTORS = {"NixlConnector": "nixl", "MooncakeConnector": "mooncake", "MoRIIOConnector": "moriio"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """One vLLM engine to start: its command-line arguments and its role in the topology."""

    index: int
    """Position in the start order over the whole plan (encoders of every model come first)."""
    name: str
    """Unique and file-name safe, e.g. ``actor-g1-decode-0``: for logs and messages."""
    model_name: str
    group_index: int
    engine_index: int
    """Position within its group."""
    worker_type: WorkerType
    model_path: str
    """vLLM's ``--model`` (given separately, as build_vllm_command expects)."""
    num_gpus: int
    num_nodes: int
    tensor_parallel_size: int
    """vLLM's ``--tensor-parallel-size`` (given separately, as build_vllm_command expects)."""
    vllm_args: dict[str, str | None]
    """Every other vLLM flag, without ``--``: the ``vllm_args`` of build_vllm_command/EngineSpec."""
    update_weights: bool
    ec_role: str | None = None
    kv_role: str | None = None
    language_only: bool = False
    """A language engine of an EPD split: it takes image embeddings from the encoder cache."""
    encoder_urls: tuple[str, ...] = ()
    """The model's encoder engines; filled by ModelLaunch.with_encoder_urls once they run."""
    router_role: RouterRole | None = "regular"
    """How to register with the model's router; None: not registered (encoders)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterLaunch:
    model_name: str
    pd_disaggregation: bool
    router_args: dict[str, str | None]
    """vllm-router flags without ``--`` (as build_router_command expects)."""
    external_url: str | None = None
    """Use this router (``--vllm-router-ip``) instead of starting one."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLaunch:
    name: str
    model_path: str
    update_weights: bool
    router: RouterLaunch
    encoders: tuple[EngineLaunch, ...]
    """Started first, and waited for: their URLs go to the language engines."""
    language_engines: tuple[EngineLaunch, ...]

    @property
    def engines(self) -> tuple[EngineLaunch, ...]:
        return self.encoders + self.language_engines

    def with_encoder_urls(self, urls: Sequence[str]) -> ModelLaunch:
        """The model with its encoders' URLs on every language-only engine: call once the
        encoders are healthy, before starting the language engines."""
        if len(urls) != len(self.encoders):
            raise ValueError(f"model {self.name}: {len(self.encoders)} encoder engine(s), got {len(urls)} URL(s)")
        engines = tuple(
            dataclasses.replace(engine, encoder_urls=tuple(urls)) if engine.language_only else engine
            for engine in self.language_engines
        )
        return dataclasses.replace(self, language_engines=engines)


GENERATED_EC_CACHE_PREFIX = "/dev/shm/vime-ec-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """What to start for a deployment, in order: routers, then ``encoders`` (wait until healthy),
    then ``language_engines`` (each registered with its model's router by ``router_role``)."""

    models: tuple[ModelLaunch, ...]
    ec_storage_path: str | None
    """The encoder-cache directory of the default connector; None without encoders."""

    @property
    def owned_ec_cache(self) -> str | None:
        """The encoder-cache directory vime made up (in shared memory): the run removes it at its end."""
        path = self.ec_storage_path
        return path if path and path.startswith(GENERATED_EC_CACHE_PREFIX) else None

    @property
    def encoders(self) -> tuple[EngineLaunch, ...]:
        return tuple(engine for model in self.models for engine in model.encoders)

    @property
    def language_engines(self) -> tuple[EngineLaunch, ...]:
        return tuple(engine for model in self.models for engine in model.language_engines)

    @property
    def engines(self) -> tuple[EngineLaunch, ...]:
        return self.encoders + self.language_engines

    def model(self, name: str) -> ModelLaunch:
        for model in self.models:
            if model.name == name:
                return model
        raise KeyError(f"no model named {name!r}; models: {', '.join(m.name for m in self.models)}")

    def with_encoder_urls(self, urls_by_model: Mapping[str, Sequence[str]]) -> LaunchPlan:
        return dataclasses.replace(
            self,
            models=tuple(
                model.with_encoder_urls(urls_by_model.get(model.name, ())) if model.encoders else model
                for model in self.models
            ),
        )

    def encoder_endpoints(self, urls_by_model: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, list[str]]]:
        """The value of ``args.vllm_model_encoder_endpoints``: {model: (served name, [encoder URL])}. The
        served name is what requests to the encoders must carry as ``model``: the model path (vLLM's
        default) unless the encoder group sets ``served_model_name`` (its first name)."""
        return {
            model.name: (_served_name(model.encoders[0]), list(urls_by_model.get(model.name, ())))
            for model in self.models
            if model.encoders
        }


def _served_name(engine: EngineLaunch) -> str:
    names = engine.vllm_args.get("served-model-name")
    return names.split()[0] if names else engine.model_path


def build_launch_plan(
    deployment: Deployment,
    *,
    router_args: Mapping[str, str | None] | None = None,
    external_router_url: str | None = None,
    ec_storage_path: str | None = None,
) -> LaunchPlan:
    """Every engine's vLLM arguments and role, and every model's router.

    Roles (EPD and PD are orthogonal): encoder -> ec_producer, prefix caching off, not routed;
    prefill -> kv_producer (+ ec_consumer, language_only with encoders); decode -> kv_consumer;
    regular -> ec_consumer, language_only with encoders. A ``kv_transfer_config`` or
    ``ec_transfer_config`` in the group's overrides (or the ``--vllm-*`` flag) replaces the
    generated one and is layered over the derived connector/role: its keys win, no deep merge.
    ``external_router_url`` serves a single-model deployment only.
    """
    if external_router_url and len(deployment.models) > 1:
        raise ConfigError(
            "--vllm-router-ip",
            f"one external router cannot serve {len(deployment.models)} models; "
            "each model needs its own router, which vime starts when --vllm-router-ip is not given",
        )
    if ec_storage_path is None and any(model.has_encoder for model in deployment.models):
        ec_storage_path = f"{GENERATED_EC_CACHE_PREFIX}{uuid.uuid4().hex}"
    drafts = {model.name: _engine_drafts(model, ec_storage_path) for model in deployment.models}
    # Number the engines in start order: the encoders of every model, then the language engines.
    next_index = {True: 0, False: sum(e.worker_type == "encoder" for d in drafts.values() for e in d)}
    models = []
    for model in deployment.models:
        engines = {True: [], False: []}  # is it an encoder?
        for engine in drafts[model.name]:
            is_encoder = engine.worker_type == "encoder"
            engines[is_encoder].append(dataclasses.replace(engine, index=next_index[is_encoder]))
            next_index[is_encoder] += 1
        models.append(
            ModelLaunch(
                name=model.name,
                model_path=model.model_path,
                update_weights=model.update_weights,
                router=_router_launch(model, engines[False], router_args or {}, external_router_url),
                encoders=tuple(engines[True]),
                language_engines=tuple(engines[False]),
            )
        )
    return LaunchPlan(models=tuple(models), ec_storage_path=ec_storage_path)


def _engine_drafts(model: ResolvedModel, ec_storage_path: str | None) -> list[EngineLaunch]:
    engines = []
    for group in model.groups:
        for e in range(group.num_engines):
            roles = _roles(group.worker_type, model.has_encoder)
            vllm_args = dict(group.vllm_args)
            if roles["ec_role"]:
                vllm_args["ec-transfer-config"] = _transfer_config(
                    group,
                    "ec",
                    {"ec_connector": DEFAULT_EC_CONNECTOR, "ec_role": roles["ec_role"]},
                    {"ec_connector_extra_config": {"shared_storage_path": ec_storage_path}},
                )
            if roles["kv_role"]:
                vllm_args["kv-transfer-config"] = _transfer_config(
                    group, "kv", {"kv_connector": DEFAULT_KV_CONNECTOR, "kv_role": roles["kv_role"]}, {}
                )
            if group.worker_type == "encoder":
                # No language model, so no KV cache for prefix caching to manage.
                vllm_args.pop("enable-prefix-caching", None)
                vllm_args["no-enable-prefix-caching"] = None
            engines.append(
                EngineLaunch(
                    index=-1,
                    name=f"{model.name}-g{group.index}-{group.worker_type}-{e}",
                    model_name=model.name,
                    group_index=group.index,
                    engine_index=e,
                    worker_type=group.worker_type,
                    model_path=model.model_path,
                    num_gpus=group.num_gpus_per_engine,
                    num_nodes=group.nodes_per_engine,
                    tensor_parallel_size=group.tensor_parallel_size,
                    vllm_args=vllm_args,
                    update_weights=model.update_weights,
                    **roles,
                )
            )
    return engines


def _roles(worker_type: str, has_encoder: bool) -> dict[str, Any]:
    """The guide's role table: EC roles only in a model with encoders, KV roles only under PD."""
    consumes_encoder = has_encoder and worker_type in ("prefill", "regular")
    return {
        "ec_role": "ec_producer" if worker_type == "encoder" else "ec_consumer" if consumes_encoder else None,
        "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}.get(worker_type),
        "language_only": consumes_encoder,
        "router_role": None if worker_type == "encoder" else worker_type,
    }


def _transfer_config(group: ResolvedGroup, kind: str, derived: dict, generated_extra: dict) -> str:
    """The JSON of ``--{kind}-transfer-config``: generated, or the user's layered over the roles."""
    field, flag = f"{kind}_transfer_config", f"{kind}-transfer-config"
    if field in group.overrides:
        user = transfer_mapping(group.overrides[field], FLAG, f"{group.path}.overrides.{field}")
    elif group.vllm_args.get(flag) is not None:
        user = transfer_mapping(group.vllm_args[flag], f"--vllm-{flag}", "the value")
    else:
        return json.dumps({**derived, **generated_extra})
    return json.dumps({**derived, **user})


def _router_launch(
    model: ResolvedModel, engines: Iterable[EngineLaunch], base: Mapping[str, str | None], external_url: str | None
) -> RouterLaunch:
    router_args = dict(base)
    if model.pd_disaggregation:
        router_args["vllm-pd-disaggregation"] = None
        connectors = {json.loads(e.vllm_args["kv-transfer-config"]).get("kv_connector") for e in engines if e.kv_role}
        if len(connectors) > 1:
            fail(
                f"model {model.name} uses several KV connectors ({', '.join(sorted(map(str, connectors)))}); "
                "its prefill and decode engines must share one"
            )
        router_name = _ROUTER_KV_CONNECTORS.get(next(iter(connectors), None))
        if router_name:
            router_args.setdefault("kv-connector", router_name)
    return RouterLaunch(
        model_name=model.name,
        pd_disaggregation=model.pd_disaggregation,
        router_args=router_args,
        external_url=external_url,
    )
