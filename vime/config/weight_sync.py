"""How new weights reach the engines: the --update-weight-* flags (docs/weights.md).

The reference framework's --update-weight-buffer-size, --update-weight-delta-encoding,
--update-weight-delta-checksum and --update-weight-local-checkpoint-dir are accepted with its meaning and act
in vime's mechanism; where that mechanism makes one moot on a run (a flag of the other transport or mode),
:meth:`WeightSyncConfig.startup_notes` says so once at start-up (``vime.preflight``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from vime.config.base import option, require

# --update-weight-delta-checksum -> the package it needs (vime.weights.delta.CHECKSUMS computes them)
CHECKSUM_PACKAGES = {"xxh3-128": "xxhash", "blake3": "blake3", "adler32": None}


def _host_directory(flag: str, path: str | None, host: str) -> str | None:
    """``path`` (a directory on ``host``, made absolute) or None; a URL, an empty path or a file is refused."""
    if path is None:
        return None
    require(path.strip() != "", flag, "must not be empty")
    require("://" not in path, flag, f"{path!r} is a URL; it must be a directory on {host}")
    require(not os.path.exists(path) or os.path.isdir(path), flag, f"{path} exists and is not a directory")
    return os.path.abspath(path)


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """How new weights reach the engines (docs/weights.md)."""

    update_weight_mode: str = option(
        "full",
        "Publish full weights, or (disk transport) a compressed XOR delta against the previous version. "
        "In delta mode a process's first publication, one to an engine without the parent version and every "
        "--update-weight-full-interval-th one are full. auto: each version full or delta, whichever of the two "
        "synchronised faster lately (the trainer's publication plus the slowest engine's load, measured; the "
        "other mode is tried again after --update-weight-full-interval publications, later when it was much "
        "slower). vime-specific.",
        choices=["full", "delta", "auto"],
    )
    update_weight_transport: str = option(
        "disk",
        "How engines receive weights: weight_v{N:06d}/ folders they reload, or an NCCL broadcast from the "
        "trainer (GPUs only; the trainer and the engines on different GPUs).",
        choices=["disk", "nccl"],
    )
    update_weight_disk_dir: str | None = option(
        None, "Where weight_v{N:06d}/ folders are written (default: <run-dir>/weights)."
    )
    update_weight_full_interval: int = option(
        10,
        "With --update-weight-mode delta: every this-many-th publication is full, which bounds the delta chain "
        "a reader replays (1: always full). vime-specific.",
    )
    flush_cache_interval: int = option(
        1,
        "1: abort in-flight requests, flush KV, update, resume. <=0: pause in place, update, continue "
        "with the existing KV. N>1: flush every N-th synchronisation.",
    )
    update_weights_interval: int = option(
        1,
        "Publish the trainer's weights to the engines after every N-th rollout (training step) instead of after "
        "each; in between the engines keep generating with the version they serve, so samples are up to N-1 "
        "steps more off-policy and a version spans N steps (--max-staleness counts versions). A step that saves "
        "a checkpoint or runs an evaluation, and the last one, always publish.",
    )
    keep_weight_versions: int = option(
        2, "Published versions kept on disk besides the newest (and the delta chains they need). vime-specific."
    )
    update_weight_buffer_size: int = option(
        512 * 1024**2,
        "Buffer size for updating weights, in bytes: weights are sent by chunks of at most this size, which helps "
        "MoE models (many small tensors). In vime: with --update-weight-transport nccl, consecutive tensors are "
        "broadcast in buckets of at most this many bytes (a larger tensor alone); the disk transport writes and "
        "reloads whole safetensors files, where it has no effect (said at start-up).",
    )
    update_weight_delta_encoding: str = option(
        "xor",
        "On-disk delta encoding for --update-weight-mode delta --update-weight-transport disk. 'xor' (default): "
        "new ^ old, the smallest and fastest, but an involution that must be applied exactly once against the "
        "right base. 'overwrite': changed positions + new values, larger but idempotent. Both are byte-level and "
        "dtype-blind; the engine reads the choice from each delta file's header.",
        choices=["xor", "overwrite"],
    )
    update_weight_delta_checksum: str = option(
        "xxh3-128",
        "Per-tensor integrity checksum for disk delta apply, checked as each tensor is rebuilt (on top of vime's "
        "sha256 of every file). 'xxh3-128' (default): wide fast non-cryptographic digest. 'blake3': "
        "cryptographic, for untrusted storage. 'adler32': 32-bit, for interop. The engine reads the choice from "
        "each delta file's header. xxh3-128 and blake3 need the xxhash / blake3 packages: without them sha256 "
        "is used (said at start-up).",
        choices=["xxh3-128", "blake3", "adler32"],
    )
    update_weight_local_checkpoint_dir: str | None = option(
        None,
        "Rollout-host-local directory (e.g. NVMe) holding a full HF checkpoint kept in sync by each engine: a "
        "published full version is copied (hard-linked where it can) as is, a delta is applied to it, and the "
        "engine reloads from it. In vime each engine keeps its own copy, in <dir>/engine_<N>/ (default: "
        "<update-weight-disk-dir>/.engine_<N>/); optional in delta mode. No effect with "
        "--update-weight-transport nccl (said at start-up).",
    )
    update_weight_trainer_dir: str | None = option(
        None,
        "Trainer-host-local directory where, with --update-weight-mode delta or auto, the trainer keeps the full "
        "files of the version it published last, to encode the next delta against (in <dir>/trainer/; default: "
        "<update-weight-disk-dir>/.trainer/, where a full version is published as hard links). On a network "
        "volume give a local disk: a delta then uploads only what changed, while a full version is copied to "
        "the volume. vime-specific.",
    )
    vllm_weight_sync_mode: str = option(
        "native",
        "How an engine takes a new weight version (the reference's flag, from its Ascend scripts). 'native': "
        "vLLM's own in-place update (its reload_weights, or the NCCL receive), the only way vime updates an "
        "engine. 'auto' (try in place, else restart the engine on the new weights) is the same in vime: an "
        "engine whose update fails is dropped and, when vime started it, restarted on the current version "
        "(--rollout-engine-restart-budget), whichever mode is given. 'reload' (a new engine process for every "
        "version) is refused.",
        choices=["native", "auto", "reload"],
    )

    def validate(self) -> None:
        require(
            self.vllm_weight_sync_mode != "reload",
            "--vllm-weight-sync-mode",
            "'reload' (a new engine process for every weight version) is not implemented: vime updates its engines "
            "in place ('native'); an engine whose update fails is restarted on the current weights, which is "
            "'auto''s fallback",
        )
        require(self.keep_weight_versions >= 1, "--keep-weight-versions", "must be >= 1")
        require(
            self.update_weights_interval >= 1,
            "--update-weights-interval",
            f"must be >= 1 (rollouts between publications), got {self.update_weights_interval}",
        )
        require(self.update_weight_full_interval >= 1, "--update-weight-full-interval", "must be >= 1")
        require(
            self.update_weight_buffer_size > 0,
            "--update-weight-buffer-size",
            f"must be a positive number of bytes, got {self.update_weight_buffer_size}",
        )
        self.update_weight_local_checkpoint_dir = _host_directory(
            "--update-weight-local-checkpoint-dir", self.update_weight_local_checkpoint_dir, "the rollout hosts"
        )
        self.update_weight_trainer_dir = _host_directory(
            "--update-weight-trainer-dir", self.update_weight_trainer_dir, "the trainer's host"
        )
        if self.update_weight_transport == "nccl":
            require(
                self.update_weight_mode == "full",
                "--update-weight-mode",
                f"{self.update_weight_mode!r} applies to the disk transport; nccl broadcasts every tensor",
            )
            # CUDA: vime.config.check_local_cuda.

    @property
    def publishes_deltas(self) -> bool:
        """Whether versions may be published as deltas (delta and auto modes): engines then keep the weights
        they hold, which a delta is applied to."""
        return self.update_weight_mode in ("delta", "auto")

    def delta_checksum(self) -> str:
        """The per-tensor checksum the delta files carry: --update-weight-delta-checksum where it can run
        here, else sha256 (startup_notes says so)."""
        package = CHECKSUM_PACKAGES[self.update_weight_delta_checksum]
        return self.update_weight_delta_checksum if package is None or importlib.util.find_spec(package) else "sha256"

    def startup_notes(self) -> list[str]:
        """What a --update-weight-* flag of the reference framework does not do on this run, one line each,
        said once at start-up. Flags left at their defaults say nothing, except a default that cannot run here."""
        notes = []
        disk, delta = self.update_weight_transport == "disk", self.publishes_deltas
        if disk and self.update_weight_buffer_size != 512 * 1024**2:
            notes.append(
                f"--update-weight-buffer-size {self.update_weight_buffer_size}: no effect with the disk transport "
                "(the trainer writes whole safetensors files, each engine reloads them); it sizes the broadcast "
                "buckets of --update-weight-transport nccl"
            )
        if not delta and self.update_weight_delta_encoding != "xor":
            notes.append(
                f"--update-weight-delta-encoding {self.update_weight_delta_encoding}: no effect with "
                f"--update-weight-mode {self.update_weight_mode} (it encodes delta versions)"
            )
        if not delta and self.update_weight_delta_checksum != "xxh3-128":
            notes.append(
                f"--update-weight-delta-checksum {self.update_weight_delta_checksum}: no effect with "
                f"--update-weight-mode {self.update_weight_mode} (full versions are checked by the sha256 of "
                "every file)"
            )
        if delta and self.delta_checksum() != self.update_weight_delta_checksum:
            notes.append(
                f"--update-weight-delta-checksum {self.update_weight_delta_checksum}: the package it needs is not "
                "installed here; delta files carry sha256 per tensor instead"
            )
        if self.update_weight_trainer_dir is not None and not (disk and delta):
            notes.append(
                f"--update-weight-trainer-dir {self.update_weight_trainer_dir}: no effect with --update-weight-mode "
                f"{self.update_weight_mode} and the {self.update_weight_transport} transport (it holds the parent "
                "of the next delta)"
            )
        if not disk and self.update_weight_local_checkpoint_dir is not None:
            notes.append(
                f"--update-weight-local-checkpoint-dir {self.update_weight_local_checkpoint_dir}: no effect with "
                "--update-weight-transport nccl (engines receive the weights in memory; nothing is kept on disk)"
            )
        return notes

    def engine_vllm_args(self, vllm_args: dict) -> dict:
        """The engines' vLLM flags plus what this transport needs (nccl: vime's worker extension)."""
        args = dict(vllm_args)
        if self.update_weight_transport == "nccl":
            from vime.weights.nccl import WORKER_EXTENSION

            other = args.get("worker-extension-cls")
            require(
                other in (None, WORKER_EXTENSION),
                "--vllm-worker-extension-cls",
                f"--update-weight-transport nccl needs vLLM's worker extension {WORKER_EXTENSION}, not {other}",
            )
            args["worker-extension-cls"] = WORKER_EXTENSION
        return args
