"""Before any process starts: everything `vime train` can check from its flags, files and hooks.

A bad path, a hook with the wrong signature, a flag vLLM does not know, a queue that a live run holds or
that was created with other flags, a checkpoint of another run, a directory the run cannot write (read-only,
not creatable, full): each fails here, naming the flag, before Ray, the router or an engine has started
(nothing is left to clean up). What the checks load on the way (the datasets, the reward, the launch plan,
the checkpoint to resume, the tokenizer) is what the run uses: :class:`Inputs`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from vime.backends import ref_load_conversion
from vime.backends.megatron_args import ModelArgs, language_model_config
from vime.config import SECTIONS, ConfigError, TrainSettings
from vime.config.evaluation import EvalDataset, resolve_eval_datasets
from vime.config.vllm import check_against_vllm, check_topology_against_vllm
from vime.data.source import DataKeys, PromptDataset, PromptSubset, open_prompt_source, rows_within_prompt_len
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
    ("algorithm", "--custom-loss-function-path"),
    ("algorithm", "--custom-advantage-function-path"),
    ("algorithm", "--custom-pg-loss-reducer-function-path"),
    ("hooks", "--custom-convert-samples-to-train-data-path"),
    ("hooks", "--rollout-all-samples-process-path"),
    ("hooks", "--custom-rollout-log-function-path"),
    ("hooks", "--custom-eval-rollout-log-function-path"),
    ("eval", "--eval-function-path"),
    ("data", "--data-source-path"),
)


class DirectoriesUnusable(UserError, OSError):
    """Directories the run would write that it cannot: one line each, naming the flag, the path and why."""


@dataclasses.dataclass
class Inputs:
    """What the checks loaded, for the run to use."""

    dataset: Any  # the prompt source (vime.data.source); with --rollout-max-prompt-len the prompts it keeps
    eval_sets: list[tuple[EvalDataset, PromptDataset]]  # each held-out set's resolved settings and prompts
    reward: Any
    plan: Any  # vime.config.vllm_config's launch plan of --vllm-config, or None
    trained_model: str | None  # the plan's weight-synced model
    resume: tuple[str, ckpt.CheckpointState] | None  # (folder, state) when resuming
    tokenizer: Any  # loaded when the driver needs it (held-out sets, --rollout-max-prompt-len), else None
    # --rollout-max-prompt-len: the source's rows it keeps (the controller opens the same subset), and how
    # many prompts the source has in all; None: no filter.
    prompt_rows: list[int] | None = None
    prompts_total: int | None = None


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
    eval_sets = load_eval_sets(s, say)
    reward = resolve_reward(RewardOptions.from_config(s.rollout))  # fails early on a bad path
    report_train_backend(s, say)
    report_megatron_lm_flags(s, say)
    report_megatron_perf_flags(s, say)
    report_hook_flags(s, say)
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
    if s.train.train_backend == "torch" and ref_load_conversion.needs_conversion(s.algorithm.ref_load):
        # The torch trainer reads HF folders: it gets the Megatron checkpoint converted (also on a resume: the
        # KL reference still comes from it).
        s.algorithm.ref_load = ref_load_conversion.hf_folder(
            s.algorithm.ref_load, s.train.hf_checkpoint, s.run_dir, say
        )
    if hf_config_checks_apply(s):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(s.train.hf_checkpoint)
        check_model_flags(s, hf_config)
        if s.train.train_backend == "megatron":
            s.perf.check_model_name(hf_config)
        check_stop_token_ids(s, getattr(hf_config, "vocab_size", None))
    else:
        check_config_file(s.train.hf_checkpoint)
    if s.train.train_backend == "torch":
        check_torch_backend_trains_it(s.train.hf_checkpoint)
    check_tokenizer_files(s.train.hf_checkpoint)
    if s.data.apply_chat_template:
        check_chat_template(s.train.hf_checkpoint)
    tokenizer = None
    if eval_sets or s.rollout.rollout_max_prompt_len is not None:  # the driver's only uses of it
        # (a run without them leaves the tokenizer to the rollout workers, which load it anyway)
        from vime.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(s.train.hf_checkpoint)
    dataset, prompt_rows, prompts_total = filter_long_prompts(s, dataset, tokenizer, say)
    report_sampling_controls(s, say)
    return Inputs(
        dataset=dataset,
        eval_sets=eval_sets,
        reward=reward,
        plan=plan,
        trained_model=trained_model,
        resume=resume,
        tokenizer=tokenizer,
        prompt_rows=prompt_rows,
        prompts_total=prompts_total,
    )


def hf_config_checks_apply(s: TrainSettings) -> bool:
    """Whether a check reads --hf-checkpoint's config through transformers: the Megatron backend's, a Megatron
    model or parallelism flag compared with config.json (every such check passes when none is given), or
    --rollout-stop-token-ids against the vocabulary. Reading it costs the driver ~3 CPU-seconds (transformers'
    configuration classes import torch), which a run without these checks does not pay: its trainer reads the
    config anyway, as it builds the model."""
    from vime.config.architecture import ArchitectureConfig
    from vime.config.megatron import MegatronConfig

    return (
        s.train.train_backend == "megatron"
        or s.megatron != MegatronConfig()
        or s.architecture != ArchitectureConfig()
        or bool(s.rollout.rollout_stop_token_ids)
    )


def check_model_flags(s: TrainSettings, hf_config) -> None:
    """The model and architecture flags against --hf-checkpoint's config.json; raises ConfigError naming the flag."""
    model = s.megatron.check_against_hf(hf_config, s.train.train_backend)
    s.architecture.check_against_hf(
        language_model_config(hf_config),
        train_backend=s.train.train_backend,
        padded_vocab=megatron_padded_vocab(s, model),
    )


def megatron_padded_vocab(s: TrainSettings, model: ModelArgs | None) -> int | None:
    """The Megatron backend's embedding rows of ``model`` (what MegatronConfig.check_against_hf resolved) for
    --padded-vocab-size's check (None: not needed, or not a model the Megatron backend builds)."""
    if s.train.train_backend != "megatron" or s.architecture.padded_vocab_size is None or model is None:
        return None
    m = s.megatron
    return model.padded_vocab_size(m.make_vocab_size_divisible_by, m.tensor_model_parallel_size)


def check_config_file(folder: str) -> None:
    """--hf-checkpoint's config.json exists and is a JSON object, as transformers needs it (read without it)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ConfigError("--hf-checkpoint", f"{folder} has no config.json") from None
    except (OSError, ValueError) as error:
        raise ConfigError("--hf-checkpoint", f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict):
        raise ConfigError("--hf-checkpoint", f"{path} holds a {type(config).__name__}, not a JSON object")


# Checkpoints HF has no causal-LM class for (the torch backend trains through AutoModelForCausalLM), and what to do
MEGATRON_ONLY_MODELS = {"qwen3_omni_moe": "Qwen3-Omni: the Megatron backend trains its thinker's language model"}


def check_torch_backend_trains_it(folder: str) -> None:
    """The torch backend can load --hf-checkpoint's model (read from config.json, without transformers)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # (said by the checks that read it)
    if model_type in MEGATRON_ONLY_MODELS:
        raise ConfigError(
            "--train-backend",
            f"torch cannot train --hf-checkpoint's {model_type} (HF has no causal-LM class for it); use "
            f"--train-backend megatron ({MEGATRON_ONLY_MODELS[model_type]})",
        )


# A folder with none of these has no tokenizer AutoTokenizer could load (fast, sentencepiece, BPE or WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_tokenizer_files(folder: str) -> None:
    """The tokenizer's files are in --hf-checkpoint: the rollout workers load it, which the driver may not."""
    if os.path.isdir(folder) and not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_FILES):
        raise ConfigError("--hf-checkpoint", f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")


def check_chat_template(folder: str) -> None:
    """--apply-chat-template needs the tokenizer's chat template: found now by its files, not by the rollout
    workers after everything has started."""
    if not os.path.isdir(folder):
        return
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")) or os.path.isfile(
        os.path.join(folder, "chat_template.json")
    ):
        return
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            if json.load(f).get("chat_template"):
                return
    raise ConfigError(
        "--apply-chat-template",
        f"the tokenizer of --hf-checkpoint {folder} has no chat template (no chat_template.jinja, "
        "chat_template.json or tokenizer_config.json's chat_template)",
    )


def check_stop_token_ids(s: TrainSettings, vocab_size: int | None) -> None:
    """--rollout-stop-token-ids within the model's vocabulary: vLLM refuses every request otherwise."""
    if not vocab_size:
        return
    outside = [token for token in s.rollout.rollout_stop_token_ids or () if token >= vocab_size]
    if outside:
        raise ConfigError(
            "--rollout-stop-token-ids", f"{outside} outside the vocabulary of --hf-checkpoint ({vocab_size} tokens)"
        )


def filter_long_prompts(
    s: TrainSettings, dataset: Any, tokenizer, say: Callable[[str], None]
) -> tuple[Any, list[int] | None, int | None]:
    """(the prompts, the rows kept, the prompts in all) under --rollout-max-prompt-len, which says how many it
    left out; without it (dataset, None, None)."""
    limit = s.rollout.rollout_max_prompt_len
    if limit is None:
        return dataset, None, None
    total = len(dataset)
    rows = rows_within_prompt_len(
        dataset,
        tokenizer,
        limit,
        apply_chat_template=s.data.apply_chat_template,
        chat_template_kwargs=s.data.apply_chat_template_kwargs,
    )
    say(
        f"--rollout-max-prompt-len {limit}: {total - len(rows)} of {total} prompts are longer and left out; "
        f"{len(rows)} remain"
    )
    return PromptSubset(dataset, rows), rows, total


def load_eval_sets(s: TrainSettings, say: Callable[[str], None]) -> list[tuple[EvalDataset, PromptDataset]]:
    """Every held-out set with its resolved settings (vime/config/evaluation.py), its prompts read with its
    own keys (--eval-input-key, an --eval-config entry's input_key, ...)."""
    if s.eval.eval_config and s.eval.eval_prompt_data:
        say(f"--eval-config {s.eval.eval_config} gives the held-out sets; --eval-prompt-data is ignored")
    sets = []
    for config in resolve_eval_datasets(s.eval, s.rollout, s.data):
        keys = DataKeys(config.input_key, config.label_key, config.metadata_key)
        sets.append((config, PromptDataset.load(config.path, keys)))
    return sets


def report_sampling_controls(s: TrainSettings, say: Callable[[str], None]) -> None:
    """Say once what the flags whose meaning vime's design changes do in this run."""
    r = s.rollout
    if r.over_sampling_batch_size is not None:
        say(
            f"--over-sampling-batch-size {r.over_sampling_batch_size}: vime's rollout workers lease one group "
            "at a time and every group the dynamic filter drops is replaced at once, so no over-sampling is "
            "needed to fill a rollout; the controller moves prompts into the queue in multiples of "
            f"{r.over_sampling_batch_size}"
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
    train_template = s.hooks.save_debug_train_data
    if train_template:  # the folder above the first placeholder
        found.append(("--save-debug-train-data", os.path.dirname(os.path.abspath(train_template).split("{")[0])))
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
        start = "--ref-load" if s.algorithm.ref_load else "--hf-checkpoint"
        say(f"--load {s.checkpoint.load} holds no checkpoint yet: starting from {start}")
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
        # They decide which prompt a journaled row is, and the order of rows.
        "rollout_max_prompt_len": s.rollout.rollout_max_prompt_len,
        "rollout_seed": s.rollout.rollout_seed,
    }


def report_train_backend(s: TrainSettings, say: Callable[[str], None]) -> None:
    """Which trainer the run uses, and why when --train-backend was not given (it depends on the machine)."""
    if not s.backend_by_default:
        return
    if s.train.train_backend == "megatron":
        why = "the default where this machine has CUDA GPUs and megatron-core"
    elif s.megatron.names_torch_only_model():
        why = "the default for the model --spec names, which only the torch backend trains (HF's implementation)"
    else:
        why = "the default on a machine without CUDA GPUs or without megatron-core, which Megatron needs"
    say(f"training backend: {s.train.train_backend} ({why})")


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
    if s.megatron.moe_token_dispatcher_type == "flex":
        say(
            "--moe-token-dispatcher-type flex: DeepEP's kernels where the trainer's GPUs have the deep_ep package, "
            "else alltoall, which sends the same tokens to the same experts (the same results)"
            if s.train.train_backend == "megatron"
            else "--moe-token-dispatcher-type flex: no effect on the torch backend (HF's MoE layers route in place)"
        )


def report_hook_flags(s: TrainSettings, say: Callable[[str], None]) -> None:
    """Say once what the data and hook flags given do on this run where that is less than their name says."""
    if s.data.multimodal_keys:
        say(
            f"--multimodal-keys {json.dumps(s.data.multimodal_keys)}: vime's engines and trainers are text-only; "
            "the media fields are not read from the records nor sent to the model (hooks see the mapping as "
            "args.multimodal_keys)"
        )
    if s.algorithm.loss_mask_type is not None:
        say(
            f"--loss-mask-type {s.algorithm.loss_mask_type}: SFT's assistant turns are located from the "
            "tokenizer's own chat template, whatever the family (vime.data.prompt.sft_tokens)"
        )
    if s.hooks.custom_config_path:
        from vime.config.base import flag_name
        from vime.config.hooks import load_custom_config

        flags = {f.name: flag_name(f) for _, cls, _ in SECTIONS for f in dataclasses.fields(cls)}
        for key, value in load_custom_config(s.hooks.custom_config_path).items():
            if key in flags:
                say(f"--custom-config-path {s.hooks.custom_config_path}: {key}: {value!r} overrides {flags[key]}")


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
