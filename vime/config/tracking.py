"""Experiment-tracking flags: wandb and TensorBoard, with the reference framework's names and meanings.

What the trackers receive and how a resumed run continues the same tracker run is vime/tracking.py's
(docs/metrics.md, "Experiment tracking").
"""

from __future__ import annotations

import dataclasses
import os
import re

from vime.config.base import option, require

WANDB_MODES = ("online", "offline", "disabled")
# wandb refuses ids with '/', '\\', '#', '?', '%' or ':'; vime keeps to what every wandb version takes.
_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclasses.dataclass(kw_only=True)
class TrackingConfig:
    use_wandb: bool = option(False, "Log every metrics.jsonl record to Weights & Biases, on the rollout-step axis.")
    wandb_project: str | None = option(None, "wandb project (required with --use-wandb unless --wandb-mode disabled).")
    wandb_group: str | None = option(
        None,
        "wandb group; also the run's name. A random suffix is added unless --disable-wandb-random-suffix.",
    )
    wandb_team: str | None = option(None, "wandb entity (team or user) the run belongs to.")
    wandb_key: str | None = option(
        None, "wandb API key to log in with (online mode only; never written to the run's config)."
    )
    wandb_host: str | None = option(None, "wandb server URL (a self-hosted W&B); online mode only.")
    wandb_mode: str | None = option(
        None,
        "online: upload as the run goes; offline: write the run under --wandb-dir for `wandb sync`; "
        "disabled: log nothing. Default: the WANDB_MODE environment variable, else online.",
        choices=list(WANDB_MODES),
    )
    wandb_dir: str | None = option(
        None, "Directory wandb writes its files in (a wandb/ folder inside it; default: --run-dir)."
    )
    wandb_run_id: str | None = option(
        None,
        "wandb run id to log to (resumed if it exists). Default: a new id, kept in tracking.json of --save so "
        "that a run resumed with --load continues the same wandb run.",
    )
    disable_wandb_random_suffix: bool = option(
        False, "Use --wandb-group as it is for the group and the run's name (no random suffix)."
    )
    use_tensorboard: bool = option(False, "Log every metrics.jsonl record to TensorBoard, on the rollout-step axis.")
    tb_project_name: str | None = option(
        None,
        "TensorBoard project: events go to tensorboard_log/<project>/<experiment> (as the reference framework's), "
        "or to $TENSORBOARD_DIR when that is set; without either, <run-dir>/tensorboard.",
    )
    tb_experiment_name: str | None = option(None, "TensorBoard experiment name (the folder under the project).")

    def validate(self) -> None:
        if self.use_wandb and self.resolved_wandb_mode != "disabled":
            require(
                bool(self.wandb_project),
                "--wandb-project",
                "is required with --use-wandb (or pass --wandb-mode disabled)",
            )
        require(
            self.wandb_run_id is None or bool(_RUN_ID.match(self.wandb_run_id)),
            "--wandb-run-id",
            f"{self.wandb_run_id!r}: use 1-64 letters, digits, '-' or '_'",
        )
        env_mode = os.environ.get("WANDB_MODE")
        require(
            self.wandb_mode is not None or not self.use_wandb or env_mode in (None, "", *WANDB_MODES, "dryrun"),
            "--wandb-mode",
            f"not given, and the environment's WANDB_MODE={env_mode!r} is none of {', '.join(WANDB_MODES)}",
        )

    @property
    def resolved_wandb_mode(self) -> str:
        """--wandb-mode, else WANDB_MODE (wandb's 'dryrun' is its old name for offline), else online."""
        mode = self.wandb_mode or os.environ.get("WANDB_MODE") or "online"
        return "offline" if mode == "dryrun" else mode

    @property
    def wandb_enabled(self) -> bool:
        return self.use_wandb and self.resolved_wandb_mode != "disabled"

    def tensorboard_dir(self, run_dir: str) -> str:
        """Where the event files go (the reference framework's rule, with a default inside the run)."""
        if os.environ.get("TENSORBOARD_DIR"):
            return os.path.abspath(os.environ["TENSORBOARD_DIR"])
        if self.tb_project_name:
            return os.path.abspath(
                os.path.join("tensorboard_log", self.tb_project_name, self.tb_experiment_name or "default")
            )
        return os.path.join(run_dir, "tensorboard")
