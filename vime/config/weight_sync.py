"""How new weights reach the engines: the --update-weight-* flags (docs/weights.md)."""

from __future__ import annotations

import dataclasses

from vime.config.base import option, require


@dataclasses.dataclass(kw_only=True)
class WeightSyncConfig:
    """How new weights reach the engines (docs/weights.md)."""

    update_weight_mode: str = option(
        "full",
        "Publish full weights, or (disk transport) a compressed XOR delta against the previous version. "
        "In delta mode a process's first publication, one to an engine without the parent version and every "
        "--update-weight-full-interval-th one are full.",
        choices=["full", "delta"],
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
    keep_weight_versions: int = option(
        2, "Published versions kept on disk besides the newest (and the delta chains they need). vime-specific."
    )

    def validate(self) -> None:
        require(self.keep_weight_versions >= 1, "--keep-weight-versions", "must be >= 1")
        require(self.update_weight_full_interval >= 1, "--update-weight-full-interval", "must be >= 1")
        if self.update_weight_transport == "nccl":
            require(
                self.update_weight_mode == "full",
                "--update-weight-mode",
                "'delta' applies to the disk transport; nccl broadcasts every tensor",
            )
            # CUDA: vime.config.check_local_cuda.

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
