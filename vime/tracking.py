"""Experiment tracking: every record vime writes to metrics.jsonl also goes to wandb and/or TensorBoard.

One step axis for everything: the rollout/training step. A step's records (its train record, the
evaluation at that step, the weight synchronisation, engine, worker and recovery events around it)
become one row, written once to each tracker when the step ends (its train record, or
:meth:`RunTracker.end_step`) or the next step's first record arrives; what comes later at that step (the
evaluation after it) joins the row under its own names. Records without a step of their own join the step
being written.

Resume (docs/metrics.md, "Experiment tracking"): a row is *reserved* in ``tracking.json`` (next to the
checkpoints) before it is written, so a step is never written twice, even when the process dies right
after. A run resumed with ``--load``, or a trainer restored in place, retrains the steps after its
checkpoint; the trackers already hold those steps (from the lineage that died), so records of a step at
or below the reservation are not written again: the axis only moves forward, and the first row written
after a resume carries ``recovery/resumed_from_step`` and ``recovery/steps_not_relogged``.
metrics.jsonl keeps every record of both lineages.
"""

from __future__ import annotations

import math
import os
import secrets
import string
import threading
from collections.abc import Iterable
from typing import Any, Protocol

import msgspec

from vime.errors import UserError
from vime.runtime.log_hooks import UNTRACKED, USER_METRICS

STATE_FILE = "tracking.json"
# Fields that place a record (kind, step), and the driver's wall clock since its own start, which restarts
# at 0 in a resumed process and would make a misleading curve.
_NOT_METRICS = {"kind", "step", "time"}


class TrackingState(msgspec.Struct):
    """What a resumed run needs to continue the same tracker runs on the same axis (``tracking.json``)."""

    schema: int = 1
    reserved_step: int = -1  # the highest step whose row was handed to the trackers (or about to be)
    wandb_run_id: str | None = None
    wandb_group: str | None = None
    wandb_name: str | None = None


def read_state(folder: str | None) -> TrackingState | None:
    path = os.path.join(folder, STATE_FILE) if folder else None
    if not path or not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return msgspec.json.decode(f.read(), type=TrackingState)


def write_state(folder: str, state: TrackingState) -> None:
    """Atomically: a crash leaves the previous reservation or the new one, never half a file."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(state))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def row_of(record: dict[str, Any]) -> dict[str, float]:
    """The tracker values of one metrics.jsonl record: its numbers, named ``<kind>/<field>`` (an evaluation's
    ``eval/<dataset>/<field>``), and ``events/<kind>[/<event>]``: 1 for a record that reports an event. A
    logging hook's numbers (the record's ``user_metrics``) keep the names the hook gave them, and the fields
    it logged itself (``untracked``) are left out (vime/runtime/log_hooks.py)."""
    kind = str(record.get("kind") or "record")
    user_metrics = dict(_numbers(record.get(USER_METRICS) or {}))
    left_out = {USER_METRICS, UNTRACKED, *record.get(UNTRACKED, ())}
    record = {name: value for name, value in record.items() if name not in left_out}
    if kind == "eval":
        prefix = f"eval/{record.get('dataset', 'default')}/"
        fields = {k.removeprefix("eval_"): v for k, v in record.items() if k != "dataset"}
    else:
        prefix, fields = f"{kind}/", record
    row = {prefix + name: float(value) for name, value in _numbers(fields)}
    row.update(user_metrics)
    if kind not in ("train", "eval", "weight_sync", "eval_log"):  # the others are events: engines, workers, ...
        row["events/" + kind + (f"/{record['event']}" if record.get("event") else "")] = 1.0
    return row


def _numbers(fields: dict[str, Any], prefix: str = "") -> Iterable[tuple[str, float]]:
    for name, value in fields.items():
        if name in _NOT_METRICS and not prefix:
            continue
        if isinstance(value, dict):
            yield from _numbers(value, f"{prefix}{name}/")
        elif isinstance(value, bool | int | float) and value is not None:
            if isinstance(value, float) and math.isinf(value):
                continue  # neither tracker plots an infinity usefully; metrics.jsonl keeps it
            yield prefix + name, value


class Sink(Protocol):
    """One tracker: gets each step's row once, in increasing step order."""

    def log(self, row: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class StepRows:
    """Turns the stream of records into one row per step, each step handed out once, steps only increasing.

    ``reserve(step)`` is called with a step before its row is handed out (the tracker persists it there);
    ``reserved`` is the highest step handed out, by an earlier process or an earlier lineage of this one.
    After a row is handed out, values this process adds to that same step under names the row does not
    have yet (the evaluation after the last step, the workers' totals as they stop) are handed out at the
    same step: a name is never written twice at one step."""

    def __init__(self, reserved: int, emit, reserve):
        self.reserved = reserved
        self._emit, self._reserve = emit, reserve
        self.open_step: int | None = None
        self.row: dict[str, float] = {}
        self.marks: dict[str, float] = {}
        self.emitted_step: int | None = None  # the last step this process handed out, and its names
        self.emitted_names: set[str] = set()
        self.not_relogged: set[int] = set()  # steps whose records came again (retrained) and were not written

    def add(self, record: dict[str, Any]) -> None:
        values = row_of(record)
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):  # an event: it joins the step being written
            if self.open_step is not None:
                step = self.open_step
            elif self.emitted_step is not None and not values.keys() & self.emitted_names:
                step = self.emitted_step
            else:
                step = self.reserved + 1
        if self.open_step is None and step == self.emitted_step:
            self._add_late(values)
            return
        if step <= self.reserved or (self.open_step is not None and step < self.open_step):
            self.not_relogged.add(step)
            return
        if self.open_step is not None and step > self.open_step:
            self.flush()
        self.open_step = step
        self.row.update(self.marks)
        self.marks = {}
        for name, value in values.items():
            # Events of a step add up; a measurement written twice in one step keeps its latest value.
            self.row[name] = self.row.get(name, 0.0) + value if name.startswith("events/") else value

    def _add_late(self, values: dict[str, float]) -> None:
        new = {name: value for name, value in values.items() if name not in self.emitted_names}
        if len(new) < len(values):
            self.not_relogged.add(self.emitted_step)
        if new:
            self.emitted_names.update(new)
            self._emit(new, self.emitted_step)

    def annotate(self, values: dict[str, float]) -> None:
        """Values for the next row written (the resume marker)."""
        self.marks.update(values)

    def end_step(self, step: int) -> None:
        if self.open_step is not None and self.open_step <= step:
            self.flush()

    def flush(self) -> None:
        if self.open_step is None:
            return
        step, row = self.open_step, self.row
        self.open_step, self.row = None, {}
        self._reserve(step)  # before the write: a step is written at most once, whatever dies when
        self.reserved = self.emitted_step = step
        self.emitted_names = set(row)
        if row:
            self._emit(row, step)


class WandbSink:
    """A wandb run (online or offline) whose own step is vime's step, on a wandb service of this process's own.

    wandb logs through a service process (wandb-core). A process whose environment names one
    (``WANDB_SERVICE``, which wandb sets in every process that started one, for its children) attaches to it
    instead of starting its own: a `vime train` started by a process that used wandb (a notebook, a script,
    a test runner) would log through that process's service, which outlives a killed run and still holds its
    run id, so that the resumed run is refused ("run ID ... is in use"). The sink therefore always starts its
    own service, carrying the run token (vime/runtime/process.py): it is stopped with the run, by the
    teardown (``wandb.teardown``), or by the reaper after a SIGKILL, and wandb-core also exits by itself when
    its parent dies."""

    def __init__(self, tracking, state: TrackingState, *, run_token: str, resumed: bool, config: dict[str, Any]):
        import wandb
        import wandb.env

        from vime.runtime.process import environment_carries_run_token

        mode = tracking.resolved_wandb_mode
        # x_disable_stats and x_transaction_log_flush_interval are wandb's x_ (experimental) settings, with no
        # public equivalent as of wandb 0.31; each is documented in wandb/sdk/wandb_settings.py there.
        settings = wandb.Settings(
            mode=mode,
            console="off",  # the progress lines are in metrics.jsonl and the logs already
            x_disable_stats=True,  # system metrics would need their own axis (wandb's time)
            # The .wandb file is buffered; wandb's default flushes it every 15 s, which a hard kill loses.
            x_transaction_log_flush_interval=1.0,
            **({"base_url": tracking.wandb_host} if tracking.wandb_host else {}),
        )
        os.makedirs(tracking.wandb_dir, exist_ok=True)
        # wandb.env.SERVICE names that variable (checked with wandb 0.31); wandb.setup() is the public way to start the
        # service before a run (a login or an init would attach to an inherited one) and names the new one there.
        os.environ.pop(wandb.env.SERVICE, None)
        with environment_carries_run_token(run_token):
            wandb.setup(settings=settings)
        try:
            if mode == "online" and tracking.wandb_key:
                wandb.login(key=tracking.wandb_key, host=tracking.wandb_host, verify=False)
            self.run = wandb.init(
                id=state.wandb_run_id,
                project=tracking.wandb_project,
                entity=tracking.wandb_team,
                group=state.wandb_group,
                name=state.wandb_name,
                dir=tracking.wandb_dir,
                config=config,
                resume="allow" if resumed else None,
                settings=settings,
                reinit="create_new",
            )
        except BaseException:
            wandb.teardown()  # the service started above stops with the failed start
            raise

    def log(self, row: dict[str, float], step: int) -> None:
        # Not committed: values added later at the same step (StepRows) join the row; wandb writes it when
        # the next step's row comes, or at the end.
        self.run.log(row, step=step)

    def close(self) -> None:
        import wandb

        try:
            self.run.finish()
        finally:
            wandb.teardown()  # this process's service: it stops now, not at the interpreter's exit


class TensorBoardSink:
    """Scalars in TensorBoard event files (torch's SummaryWriter, on the tensorboard package)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        # A resumed run adds a new event file to the same folder; steps only increase, so TensorBoard's
        # reader purges nothing and shows one curve per tag.
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, row: dict[str, float], step: int) -> None:
        for name, value in row.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a hard kill keeps every row written so far

    def close(self) -> None:
        self.writer.close()


def generate_id(length: int = 8) -> str:
    """A wandb-style run id (lower-case letters and digits)."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


def new_wandb_identity(tracking) -> tuple[str, str | None, str | None]:
    """(run id, group, name) of a new wandb run: the reference framework's naming."""
    group = tracking.wandb_group
    if group and not tracking.disable_wandb_random_suffix:
        group = f"{group}_{generate_id()}"
    return tracking.wandb_run_id or generate_id(), group, group


class TrackerStartError(UserError, RuntimeError):
    """A tracker could not start (a wandb login, an unwritable folder); the message names the flag."""


class RunTracker:
    """The run's trackers behind one step axis; thread-safe (engine events arrive from supervisor threads)."""

    def __init__(self, sinks: list[Sink], state: TrackingState, state_dir: str, *, resumed_from: int | None = None):
        self.sinks, self.state, self.state_dir = sinks, state, state_dir
        self._lock = threading.Lock()
        self.rows = StepRows(state.reserved_step, self._emit, self._reserve)
        if resumed_from is not None:  # the first row written says where the run came back from
            self.rows.annotate(
                {
                    "recovery/resumed_from_step": float(resumed_from),
                    "recovery/steps_not_relogged": float(max(0, state.reserved_step - resumed_from)),
                }
            )

    @classmethod
    def start(cls, settings, *, run_token: str, resumed_from: int | None, say=print) -> RunTracker | None:
        """The trackers the flags ask for (None: none). ``resumed_from``: the checkpoint step a --load resumes;
        ``run_token``: carried by the processes a tracker starts (wandb's service), so that they stop with the run."""
        tracking = settings.tracking
        if tracking.use_wandb and not tracking.wandb_enabled:
            say("--wandb-mode disabled: nothing is sent to wandb")
        if not (tracking.wandb_enabled or tracking.use_tensorboard):
            return None
        state_dir = settings.checkpoint.save or settings.run_dir
        state = None
        if resumed_from is not None:  # the resumed run's state: its --save is this run's --load
            state = read_state(settings.checkpoint.load) or read_state(state_dir)
        state = state or TrackingState()
        if tracking.wandb_enabled:
            state = _wandb_identity(tracking, state)
        write_state(state_dir, state)
        sinks: list[Sink] = []
        flag = "--use-tensorboard"
        try:
            if tracking.use_tensorboard:
                sinks.append(TensorBoardSink(tracking.tensorboard_dir(settings.run_dir)))
            if tracking.wandb_enabled:
                flag = "--use-wandb"
                resumed = resumed_from is not None or bool(tracking.wandb_run_id)
                sinks.append(
                    WandbSink(
                        tracking, state, run_token=run_token, resumed=resumed, config=_public_config(settings.args)
                    )
                )
        except Exception as error:  # whatever stops a tracker's start is said as one line naming the flag
            for sink in sinks:
                sink.close()
            raise TrackerStartError(f"{flag}: the tracker did not start: {type(error).__name__}: {error}") from error
        where = [
            f"TensorBoard in {sink.log_dir}"
            if isinstance(sink, TensorBoardSink)
            else f"wandb run {state.wandb_run_id} ({tracking.resolved_wandb_mode}, in {tracking.wandb_dir})"
            for sink in sinks
        ]
        if resumed_from is not None and state.reserved_step >= 0:
            where.append(f"steps up to {state.reserved_step} are already there and are not written again")
        say("tracking: " + "; ".join(where))
        return cls(sinks, state, state_dir, resumed_from=resumed_from)

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.rows.add(record)
            if record.get("kind") == "train":  # the step's row goes out now; its evaluation joins it late
                self.rows.end_step(record["step"])

    def end_step(self, step: int) -> None:
        with self._lock:
            self.rows.end_step(step)

    def close(self) -> None:
        with self._lock:
            try:
                self.rows.flush()
            finally:
                for sink in self.sinks:
                    sink.close()

    def _reserve(self, step: int) -> None:
        self.state = msgspec.structs.replace(self.state, reserved_step=step)
        write_state(self.state_dir, self.state)

    def _emit(self, row: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(row, step)


def _wandb_identity(tracking, state: TrackingState) -> TrackingState:
    """The wandb run this process logs to: --wandb-run-id, else the resumed run's, else a new one."""
    if state.wandb_run_id and tracking.wandb_run_id in (None, state.wandb_run_id):
        return state  # the same run, with its names
    run_id, group, name = new_wandb_identity(tracking)
    return msgspec.structs.replace(state, wandb_run_id=run_id, wandb_group=group, wandb_name=name)


def _public_config(args) -> dict[str, Any]:
    """The run's flags as the wandb config, without the API key."""
    config = {}
    for name, value in vars(args).items():
        if name == "wandb_key":
            continue
        if isinstance(value, str | int | float | bool | list | tuple | dict) or value is None:
            config[name] = value
    return config
