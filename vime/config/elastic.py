"""Engine health checks, restarts and elastic membership (docs/elastic.md)."""

from __future__ import annotations

import dataclasses

from vime.config.base import option, require


@dataclasses.dataclass(kw_only=True)
class ElasticConfig:
    """Engine health checks, restarts and elastic membership (docs/elastic.md)."""

    rollout_health_check_interval: float = option(
        10.0, "Seconds between two /health checks of each rollout engine (a monitor thread of the driver)."
    )
    rollout_health_check_timeout: float = option(
        10.0, "Seconds one /health check may take; a check that times out counts as failed."
    )
    rollout_health_check_first_wait: float = option(
        0.0,
        "Grace period in seconds after an engine starts serving before its health is checked (time to "
        "compile and warm up).",
    )
    rollout_health_check_failures: int = option(
        2,
        "Consecutive failed checks after which an engine is declared dead: it is unregistered from the router "
        "at once and, if vime started it, restarted at the current weight version. vime-specific.",
    )
    rollout_engine_restart_budget: int = option(
        3,
        "Restarts allowed per engine vime started; an engine that dies more often is dropped (the run goes on "
        "while some engine serves). vime-specific.",
    )
    rollout_router_restart_budget: int = option(
        3,
        "Restarts allowed for each vllm-router vime started: a router that exits is started again at its "
        "address with the serving engines registered again, while the run goes on; once the budget is spent, "
        "the run stops. A router given with --vllm-router-ip is not restarted. vime-specific.",
    )
    rollout_elastic_resource: str = option(
        "vime_rollout",
        "Ray custom resource that marks a rollout node: every alive node that has it and hosts no "
        "engine of this run gets max(1, amount / --rollout-num-gpus-per-engine) engines and a rollout worker, "
        "while the run goes on. '' turns node watching off. vime-specific.",
    )
    rollout_elastic_node_engines: bool = option(
        True,
        "Whether a node that joins with --rollout-elastic-resource gets engines. With "
        "--no-rollout-elastic-node-engines it gets a rollout worker only, at once: for a --rollout-function-path "
        "that generates without this run's engines. vime-specific.",
    )

    def validate(self) -> None:
        require(self.rollout_health_check_interval > 0, "--rollout-health-check-interval", "must be > 0")
        require(self.rollout_health_check_timeout > 0, "--rollout-health-check-timeout", "must be > 0")
        require(self.rollout_health_check_first_wait >= 0, "--rollout-health-check-first-wait", "must be >= 0")
        require(self.rollout_health_check_failures >= 1, "--rollout-health-check-failures", "must be >= 1")
        require(self.rollout_engine_restart_budget >= 0, "--rollout-engine-restart-budget", "must be >= 0")
        require(self.rollout_router_restart_budget >= 0, "--rollout-router-restart-budget", "must be >= 0")
