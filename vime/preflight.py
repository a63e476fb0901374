"""Before any process starts: everything `vime train` can check from its flags, files and hooks.

A bad path, a hook with the wrong signature, a flag vLLM does not know, a queue that a live run holds or
that was created with other flags, a checkpoint of another run, a directory the run cannot write (read-only,
not creatable, full): each fails here, naming the flag, before Ray, the router or an engine has started
(nothing is left to clean up). What the checks load on the way (the datasets, the reward, the launch plan,
the checkpoint to resume, the tokenizer) is what the run uses: :class:`Inputs`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from vime.config import ConfigError, TrainSettings
from vime.config.vllm import check_against_vllm, check_topology_against_vllm
from vime.data.source import DataKeys, PromptDataset, open_prompt_source
from vime.errors import UserError
from vime.recovery import checkpoint as ckpt
from vime.recovery.disk_space import why_unwritable
from vime.rollout.rewards import RewardOptions, resolve_reward
from vime.runtime.plugins import absolute_plugin_path, load_hook

# The user hooks: each is made an absolute path (workers may run elsewhere), loaded and its signature
# checked (vime/runtime/plugins.py).
HOOK_FLAGS = (
    ("rollout", "--custom-rm-path"),
    ("rollout", "--custom-generate-function-path"),
    ("rollout", "--rollout-function-path"),
    ("rollout", "--dynamic-sampling-filter-path"),
    ("algorithm", "--custom-reward-post-process-path"),
    ("eval", "--eval-function-path"),
    ("data", "--data-source-path"),
)


class DirectoriesUnusable(UserError, OSError):
    """Directories the run would write that it cannot: one line each, naming the flag, the path and why."""


@dataclasses.dataclass
class Inputs:
    """What the checks loaded, for the run to use."""

    dataset: Any  # the prompt source (vime.data.source)
    eval_sets: list[tuple[str, PromptDataset]]
    reward: Any
    plan: Any  # vime.config.vllm_config's launch plan of --vllm-config, or None
    trained_model: str | None  # the plan's weight-synced model
    resume: tuple[str, ckpt.CheckpointState] | None  # (folder, state) when resuming
    tokenizer: Any


def check_inputs(s: TrainSettings, say: Callable[[str], None]) -> Inputs:
    """Every check of the run's inputs, in the order a user fixes them; raises ConfigError (and the other
    UserErrors of the loaders) naming the flag."""
    keys = DataKeys(s.data.input_key, s.data.label_key, s.data.metadata_key)
    for section_name, flag in HOOK_FLAGS:
        section, name = getattr(s, section_name), flag[2:].replace("-", "_")
        setattr(section, name, absolute_plugin_path(getattr(section, name)))
        if getattr(section, name):
            load_hook(flag, getattr(section, name))
    dataset = open_prompt_source(s.data.prompt_data, keys, data_source_path=s.data.data_source_path, args=s.args)
    eval_sets = [(name, PromptDataset.load(path, keys)) for name, path in s.eval.datasets]
    reward = resolve_reward(RewardOptions.from_config(s.rollout))  # fails early on a bad path
    report_megatron_lm_flags(s, say)
    report_megatron_perf_flags(s, say)
    for note in s.weights.startup_notes():  # reference --update-weight-* flags that are moot on this run
        say(note)
    plan, trained_model = plan_engines(s)
    check_against_vllm(s.vllm.vllm_args)
    check_topology_against_vllm(getattr(s.args, "vllm_deployment", None))  # --vllm-config overrides
    if s.queue.rollout_data_transport == "straw":
        from vime.queue.fence import QueueFence

        QueueFence.acquire(s.rollout_data_dir).release()  # a live run on this queue fails us now
        check_queue_identity(s)
    resume = checkpoint_to_resume(s, say)
    from transformers import AutoConfig, AutoTokenizer

    s.megatron.check_against_hf(AutoConfig.from_pretrained(s.train.hf_checkpoint), s.train.train_backend)
    tokenizer = AutoTokenizer.from_pretrained(s.train.hf_checkpoint)
    return Inputs(
        dataset=dataset,
        eval_sets=eval_sets,
        reward=reward,
        plan=plan,
        trained_model=trained_model,
        resume=resume,
        tokenizer=tokenizer,
    )


def written_directories(s: TrainSettings) -> list[tuple[str, str]]:
    """(flag, local path) of every directory the run writes; a debug replay writes only its --run-dir."""
    if s.debug.load_debug_rollout_data:
        return [("--run-dir", s.run_dir)]
    found = [
        ("--save", s.checkpoint.save),
        ("--rollout-data-dir", s.rollout_data_dir),  # the queue, and the record of incarnations with any transport
        ("--run-dir", s.run_dir),
        ("--update-weight-disk-dir", s.weight_dir),
    ]
    local = s.weights.update_weight_local_checkpoint_dir
    if local and s.weights.update_weight_transport == "disk" and not s.cluster.ray_address:
        found.append(("--update-weight-local-checkpoint-dir", local))  # on the rollout hosts: this one, in-process
    template = s.debug.save_debug_rollout_data
    if template:  # the folder above the first path component that holds '{rollout_id}'
        found.append(("--save-debug-rollout-data", os.path.dirname(os.path.abspath(template).split("{")[0])))
    roles = s.algorithm.role_config()
    critic_save = roles.role("critic").save
    if critic_save:
        found.append((f"--megatron-config-path {roles.source} (the critic's save)", os.path.abspath(critic_save)))
    tracking = s.tracking
    if tracking.wandb_enabled:
        found.append(("--wandb-dir", tracking.wandb_dir))
    if tracking.use_tensorboard:
        found.append(("--use-tensorboard (its event folder)", tracking.tensorboard_dir(s.run_dir)))
    return [(flag, path) for flag, path in found if path and "://" not in path]


def check_written_directories(s: TrainSettings) -> None:
    """Each directory the run writes exists or can be created, takes a file (tried: vime/recovery/disk_space.py)
    and has space left. Called by `vime train` right after its flags are parsed, before the run creates its
    directories or starts its reaper. Raises DirectoriesUnusable: one line per unusable path, naming its flags."""
    flags_of: dict[str, list[str]] = {}
    for flag, path in written_directories(s):
        flags_of.setdefault(os.path.abspath(path), []).append(flag)
    failures = [
        f"{' and '.join(flags)} {path}: {cause}"
        for path, flags in flags_of.items()
        if (cause := why_unwritable(path)) is not None
    ]
    if len(failures) == 1:
        raise DirectoriesUnusable(failures[0])
    if failures:
        raise DirectoriesUnusable(
            f"{len(failures)} directories the run writes are unusable:\n  " + "\n  ".join(failures)
        )


def storage_declaration(s: TrainSettings) -> dict | None:
    """What straw is told of --rollout-data-dir's file system. With --rollout-storage-profile juicefs the mount
    is read and checked (queue/juicefs_mount.py): one without the queue's guarantees (write-back caching,
    say) or that contradicts --rollout-storage-declaration is refused here, naming the option and the fix.
    Called by `vime train` right after its flags are parsed, before any directory or process is made."""
    q = s.queue
    if q.rollout_data_transport != "straw" or q.rollout_storage_profile != "juicefs":
        return q.storage_declaration()
    from vime.queue.juicefs_mount import checked_declaration

    return checked_declaration(s.rollout_data_dir, q.storage_declaration())


def checkpoint_to_resume(s: TrainSettings, say: Callable[[str], None]) -> tuple[str, ckpt.CheckpointState] | None:
    """The checkpoint --load (--ckpt-step) resumes, checked against this run's options; None: start afresh."""
    if not s.checkpoint.load:
        return None
    if ckpt.latest_step(s.checkpoint.load) is None and s.checkpoint.ckpt_step is None:
        # As the reference framework does: a --load without a checkpoint starts afresh.
        say(f"--load {s.checkpoint.load} holds no checkpoint yet: starting from --hf-checkpoint")
        return None
    resume = ckpt.load_state(s.checkpoint.load, s.checkpoint.ckpt_step)
    ckpt.check_run_options(resume[1].run_options, run_options(s))
    if s.queue.rollout_data_transport != "straw":
        raise ConfigError("--load", "resuming needs the durable queue (--rollout-data-transport straw)")
    return resume


def run_options(s: TrainSettings) -> dict[str, Any]:
    """The options a checkpoint records and a resumed run must keep (vime/recovery/checkpoint.py)."""
    return {
        "prompt_data": s.data.prompt_data,
        "n_samples_per_prompt": s.rollout.n_samples_per_prompt,
        "rollout_queue_run_id": s.queue.rollout_queue_run_id,
        "seed": s.run.seed,
        "rollout_batch_size": s.rollout.rollout_batch_size,
        "input_key": s.data.input_key,
        "label_key": s.data.label_key,
        "rollout_shuffle": s.data.rollout_shuffle,
    }


def report_megatron_lm_flags(s: TrainSettings, say: Callable[[str], None]) -> None:
    """Say what the Megatron-LM flags passed through do (vime/config/megatron_lm.py): a flag vime's trainer does
    not read reaches user code only, which a user should not have to guess."""
    passthrough = s.megatron_lm
    if not passthrough.values:
        return
    from vime.config.megatron_lm import transformer_overrides

    model = transformer_overrides(passthrough) if s.train.train_backend == "megatron" else {}
    if model:
        say(
            "Megatron-LM flags set the model's TransformerConfig: "
            + ", ".join(passthrough.flags[name] for name in model)
        )
    rest = [flag for name, flag in passthrough.flags.items() if name not in model]
    if rest:
        say("Megatron-LM flags that vime's trainer does not read (user code sees them in args): " + ", ".join(rest))


def report_megatron_perf_flags(s: TrainSettings, say: Callable[[str], None]) -> None:
    """Say once what the kernel, fusion, offload and memory flags given do on this run's backend
    (vime/config/megatron_perf.py): several ask for what vime's backends do not have, which a user should
    read at start-up rather than find out from a profile."""
    for note in s.perf.startup_notes(s.train.train_backend):
        say(note)


def plan_engines(s: TrainSettings) -> tuple[Any, str | None]:
    """What to start, from the resolved topology (vime/config/vllm_launch.py): (the launch plan, the trained
    model's name); (None, None) without --vllm-config (and with --rollout-external-engine-addrs)."""
    from vime.config.vllm_deployment import trained_model_name
    from vime.config.vllm_launch import build_launch_plan

    deployment = getattr(s.args, "vllm_deployment", None)
    if deployment is None:
        return None, None
    trained_model = trained_model_name(deployment)
    flag = {"vllm-config": "--vllm-config", "prefill-num-servers": "--prefill-num-servers"}.get(deployment.origin)
    pd = any(group.worker_type in ("prefill", "decode") for model in deployment.models for group in model.groups)
    if pd and s.vllm.vllm_router_ip:
        raise ConfigError(
            "--vllm-router-ip",
            "vime starts the prefill/decode engines of this topology, and a PD "
            "router learns its engines from its command line: leave --vllm-router-ip out (vime "
            "starts the router), or start the engines yourself and attach them with "
            "--rollout-external-engine-addrs",
        )
    plan = build_launch_plan(deployment, router_args=s.router_args)
    teacher = s.algorithm.opd_teacher_model
    if teacher and teacher not in {model.name for model in deployment.models}:
        raise ConfigError(
            "--opd-teacher-model",
            f"{teacher!r} is not a model of "
            f"{flag or '--vllm-config'}; models: {', '.join(m.name for m in deployment.models)}",
        )
    return plan, trained_model


def check_queue_identity(s: TrainSettings) -> None:
    """An existing queue keeps the identity it was created with (straw refuses to recover it otherwise):
    say which flag differs instead."""
    path = os.path.join(s.rollout_data_dir, "run.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        identity = json.load(f)
    q = s.queue
    for flag, created, now in (
        ("--rollout-queue-run-id", identity.get("run_id"), q.rollout_queue_run_id),
        ("--rollout-queue-lease-seconds", identity.get("lease_seconds"), q.rollout_queue_lease_seconds),
        ("--rollout-storage-profile", identity.get("profile"), q.rollout_storage_profile),
    ):
        if created is not None and created != now:
            raise ConfigError(
                flag,
                f"the queue in {s.rollout_data_dir} was created with {created!r}, "
                f"this run has {now!r}; keep it, or use another --rollout-data-dir",
            )
