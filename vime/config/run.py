"""The run as a whole (seed, run directory, timeouts, disk warnings) and debug replay."""

from __future__ import annotations

import dataclasses

from vime.config.base import option, require


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    seed: int = option(1234, "Random seed (model init of the trainer's RNG, sampling seeds, shuffling).")
    run_dir: str | None = option(
        None,
        "Where metrics.jsonl, logs, the reward curve and the final model go (default: --save, "
        "else outputs/<time>). vime-specific.",
    )
    engine_startup_timeout: float = option(300.0, "Seconds to wait for one engine to become healthy.")
    http_timeout: float = option(60.0, "Seconds before a control call to an engine or the router fails.")
    log_level: str = option("info", "Log level.", choices=["debug", "info", "warning", "error"])
    min_free_disk_gb: float = option(
        5.0,
        "Free space (GB) below which the run warns, once each time it falls below, about the volume of "
        "--rollout-data-dir, --save or --update-weight-disk-dir: with the bytes the run fills there per step and "
        "what would help (online GC, --save-interval, --keep-weight-versions, a bigger volume). Every train "
        "record carries their free space (disk_free_gb/queue, /checkpoint, /weights); 0: no warning. "
        "vime-specific.",
    )

    def validate(self) -> None:
        require(self.engine_startup_timeout > 0, "--engine-startup-timeout", "must be > 0")
        require(self.http_timeout > 0, "--http-timeout", "must be > 0")
        require(self.min_free_disk_gb >= 0, "--min-free-disk-gb", "must be >= 0 (0 turns the warning off)")


@dataclasses.dataclass(kw_only=True)
class DebugConfig:
    save_debug_rollout_data: str | None = option(
        None,
        "After each trained step, keep an immutable archive of exactly the batch trained (every sample "
        "field, the policy version, the step's loss and gradient norm) at this path, which must contain "
        "'{rollout_id}' (e.g. debug/{rollout_id}.vdr). An existing archive is never replaced: a step retrained "
        "after a resume accepts an identical one, anything else stops the run. See docs/replay.md.",
        metavar="PATH",
    )
    load_debug_rollout_data: str | None = option(
        None,
        "Train on the batches recorded with --save-debug-rollout-data (the same '{rollout_id}' path) "
        "without engines, router or rollout workers; on CPU with the same flags it reproduces the recorded "
        "losses and gradient norms bit for bit. Writes no checkpoint.",
        metavar="PATH",
    )
    debug_rollout_only: bool = option(
        False,
        "Only generate: rollouts are generated, scored and stored in the queue as in training, but nothing is "
        "trained (the engines keep the initial weights, no weight is published, no checkpoint written). Each "
        "step takes --rollout-batch-size accepted groups and writes a 'rollout' record to metrics.jsonl; the "
        "rollout stays --max-staleness steps ahead of the steps, as in training. Measures the rollout path "
        "alone (bench/rollout).",
    )
    debug_train_only: bool = option(
        False,
        "Only train (the reference's SFT scripts pass it): no engine is started and no weight version is "
        "published to one; the rollout function fills the queue and the trainers train, checkpoint and save as "
        "usual. The rollout must not generate: a --rollout-function-path that reads its samples (e.g. "
        "vime.rollout.sft_rollout.generate_rollout) or --load-debug-rollout-data. A node that joins with "
        "--rollout-elastic-resource gets a rollout worker and no engine.",
    )

    def validate(self) -> None:
        require(
            not (self.debug_rollout_only and self.debug_train_only),
            "--debug-train-only",
            "cannot be combined with --debug-rollout-only (one trains nothing, the other generates nothing)",
        )
        for flag, value in (
            ("--save-debug-rollout-data", self.save_debug_rollout_data),
            ("--load-debug-rollout-data", self.load_debug_rollout_data),
        ):
            require(
                not (self.debug_rollout_only and value),
                "--debug-rollout-only",
                f"cannot be combined with {flag} (a rollout-only run trains no batch)",
            )
        require(
            not (self.save_debug_rollout_data and self.load_debug_rollout_data),
            "--load-debug-rollout-data",
            "cannot be combined with --save-debug-rollout-data (a replay trains on archives, it records none)",
        )
        if self.save_debug_rollout_data is None and self.load_debug_rollout_data is None:
            return
        from vime.recovery.debug_archive import check_template, existing_archives

        if self.save_debug_rollout_data is not None:
            check_template(self.save_debug_rollout_data, "--save-debug-rollout-data")
        if self.load_debug_rollout_data is not None:
            check_template(self.load_debug_rollout_data, "--load-debug-rollout-data")
            require(
                bool(existing_archives(self.load_debug_rollout_data)),
                "--load-debug-rollout-data",
                f"no archive matches {self.load_debug_rollout_data!r} (nothing was recorded there)",
            )
