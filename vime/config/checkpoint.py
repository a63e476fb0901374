"""Checkpoints: --save, --load, retention and the trainer's in-place restart budget."""

from __future__ import annotations

import dataclasses

from vime.config.base import option, require


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    save: str | None = option(
        None, "Checkpoint directory: iter_XXXXXXX/ folders and latest_checkpointed_iteration.txt."
    )
    save_interval: int | None = option(None, "Save every this many rollouts (and at the end).")
    save_retain_last: int | None = option(
        None,
        "Keep only the last this many complete checkpoints in --save (the latest always stays; older ones are "
        "deleted oldest first once a newer one is recorded and committed). Default: keep every checkpoint. "
        "vime-specific (Megatron-LM has only --save-retain-interval).",
    )
    save_retain_interval: int | None = option(
        None,
        "Checkpoints whose step is a multiple of this are kept for good; the others, except the last "
        "--save-retain-last (default 1), are deleted (Megatron-LM's flag). A multiple of --save-interval.",
    )
    load: str | None = option(None, "Resume from this checkpoint directory.")
    ckpt_step: int | None = option(None, "Step to load from --load (default: latest_checkpointed_iteration.txt).")
    no_load_optim: bool = option(
        False,
        "Resuming from --load, do not load the optimizer's state (Megatron-LM's flag): the trainer takes the "
        "checkpoint's weights, RNG and position in the run, while AdamW's moments start at zero and the learning-"
        "rate schedule (warm-up included) starts over, as Megatron-LM's scheduler does without its state. A "
        "trainer restored in place loads that checkpoint the same way, and a checkpoint this run saved whole.",
    )
    save_hf: bool = option(True, "Save the final model as an HF checkpoint in <run-dir>/hf_final. vime-specific.")
    trainer_restart_budget: int = option(
        3,
        "Times a trainer that died (or failed with an internal error) is restarted in place from the latest "
        "checkpoint in --save while generation goes on (docs/queue-and-recovery.md); 0: the run stops instead. "
        "vime-specific.",
    )

    def validate(self) -> None:
        require(self.trainer_restart_budget >= 0, "--trainer-restart-budget", "must be >= 0")
        require(self.save_interval is None or self.save_interval >= 1, "--save-interval", "must be >= 1")
        require(self.save_interval is None or self.save is not None, "--save-interval", "needs --save")
        require(self.ckpt_step is None or self.load is not None, "--ckpt-step", "needs --load")
        require(self.save_retain_last is None or self.save_retain_last >= 1, "--save-retain-last", "must be >= 1")
        require(self.save_retain_last is None or self.save is not None, "--save-retain-last", "needs --save")
        require(
            self.save_retain_interval is None or self.save_retain_interval >= 1,
            "--save-retain-interval",
            "must be >= 1",
        )
        require(
            self.save_retain_interval is None or self.save_interval is not None,
            "--save-retain-interval",
            "needs --save-interval",
        )
        require(
            self.save_retain_interval is None or self.save_retain_interval % self.save_interval == 0,
            "--save-retain-interval",
            f"must be a multiple of --save-interval ({self.save_interval})",
        )
