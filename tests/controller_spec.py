"""The tests' controller over a real queue: digit prompts and one ``ControllerSpec`` with the defaults they share.

Every test that drives ``vime.workers.controller.Controller`` directly (no `vime train`) builds the same spec and
changes one or two of its values (the transport, the rollout's size, the staleness bound); here it writes only
those.
"""

from __future__ import annotations

import json
from pathlib import Path

from vime.data.source import DataKeys
from vime.queue.gc import group_submission_id
from vime.queue.rollout_queue import StoreOptions
from vime.queue.transport import GroupToPublish
from vime.sample import Sample, Status
from vime.workers.controller import ControllerSpec


def write_prompts(folder: Path, count: int) -> str:
    """``count`` prompts ``"000="``, ``"001="``, ... labelled with their number, as folder/prompts.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i:03d}=", "label": str(i)}) + "\n" for i in range(count)))
    return str(path)


def controller_spec(folder: Path, prompts: str, **overrides) -> ControllerSpec:
    """A straw queue in folder/queue (run id "run"), 2 groups a rollout, staleness 1, epochs until stopped, the
    prompts in file order; ``overrides`` replace any of these."""
    values = dict(
        transport="straw",
        store=StoreOptions(str(folder / "queue"), "run", 1.0),
        lease_seconds=60,
        prompt_data=prompts,
        keys=DataKeys("prompt", "label"),
        seed=0,
        shuffle=False,
        num_epoch=None,
        groups_per_rollout=2,
        max_staleness=1,
    )
    return ControllerSpec(**{**values, **overrides})


def completed_group(task, response: int, version: int = 0) -> list[Sample]:
    """The two completed samples a rollout worker would publish for ``task`` (a PromptTask): 2 prompt tokens and
    ``response`` response tokens each, reward 1, every token from weight ``version``."""
    return [
        Sample(
            group_index=task.group_index,
            index=i,
            prompt_index=task.prompt_index,
            tokens=[1] * (2 + response),
            response_length=response,
            reward=1.0,
            status=Status.COMPLETED,
            weight_versions=[version] * response,
        )
        for i in range(2)
    ]


def group_to_publish(item, response: int) -> GroupToPublish:
    """What a rollout worker hands its publisher for the leased prompt ``item`` (a LeasedPrompt): the task's
    completed group (``completed_group``) under its attempt's submission id."""
    lease = item.assignment.lease
    samples = completed_group(item.assignment.task, response)
    return GroupToPublish(
        samples, lease.task_id, lease.attempt_id, group_submission_id(lease.task_id, lease.attempt_id)
    )
