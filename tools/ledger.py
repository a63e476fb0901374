"""The ledger of ``vime queue inspect``: every group the run generated, accounted for from the files on disk.

    generated = trained + waiting + discarded (stale, lost_with_lineage, filtered, failed, released_orphan)

for the whole run and per lineage, in groups and in response tokens (the sum of the samples'
``response_length``: the generated tokens, not the prompts). It must close after any fault: a group
that cannot be placed is *unaccounted*, a group trained twice in the surviving lineage is counted
apart, and either means the ledger does not close (docs/queue-and-recovery.md, "The ledger").

Where each number comes from:

- **generated**: the groups the queue's journal accepted (``Completed``), the tasks it ended
  *rejected* or *failed*, and the released orphans (below). Tasks still fresh, leased or carried as
  continuations have generated no group yet: they are reported as ``in_flight``, outside the sum.
- **trained**: the accepted positions before the surviving lineage's cursor that it did not skip
  (the latest checkpoint in ``--save``, else the queue's committed consumer state). Counted from the
  cursor, not from the journal, so a cursor past the accepted groups shows as trained groups nobody
  generated (``phantom_trained``) and the ledger does not close.
- **waiting**: accepted groups at or after the cursor, not yet consumed nor decided.
- **stale**: accepted groups skipped as too stale for ``--max-staleness`` (or skipped because their
  prompt was already submitted again in a lineage lost since), proven by their prompt's resubmission
  (task ``r<position>``) in the journal. A skipped group whose prompt was never resubmitted is lost:
  *unaccounted*. A group after the cursor whose prompt was resubmitted is decided too (a lineage that
  went further, then was rewound, skipped it): it counts as discarded, not waiting.
- **lost_with_lineage**: the same, for a group carrying a token of a version a trainer restored in
  place threw away (``Lineage.lost``, recovery/lineage.py), read from the group's payload. A group
  trained in a lineage that was later rewound is not discarded by the code: the rewind puts it after
  the cursor again, and it is trained again (once) in the surviving lineage, or discarded here when
  it carries a lost version. When the payload was reclaimed (online GC), a skipped group counts as
  stale.
- **filtered**: tasks the dynamic filter (``--dynamic-sampling-filter-path``) rejected. The code has
  no separate over-sampling discard: over-sampling is the filter dropping groups. No payload is
  published for them, so their tokens are not on disk.
- **failed**: tasks that ended failed, their attempts spent (also those ``vime queue retry-failed``
  submitted again: the retry is a new task, so a new group of the ledger). No payload, no tokens.
- **released_orphan**: a group payload published under an attempt the queue never accepted (the
  lease moved on, so the worker released it; or its writer died before acceptance, and the reaping
  of dead writers or ``vime queue gc`` releases it), found by the group's submission id in the
  writer's publication receipts. Attempts leased by a worker id without ``@<writer>`` cannot be
  looked up, nor those of a writer busy publishing right now (a live run). Nor, as in the reaping, those
  whose outcome leaves nothing to release (``WriterPublications.unadopted``): an attempt its worker failed
  or gave back untouched before it leased a group that was accepted is not looked up, so a payload the
  worker gave up there (a hand-over call that raised) is not counted, as a generated group either.

Lineages: the run's start and each restore in place of the trainer (``Lineage.restores`` in the
checkpoint or in the queue's committed state) begin a lineage; a group belongs to the lineage whose
weights generated its newest token. Groups with no payload on disk (filtered, failed, unreadable)
belong to none and have a row of their own. A ``--load`` of an older checkpoint starts no lineage
here: it publishes the checkpoint's own version numbers again (docs/queue-and-recovery.md, "Not done
yet"), so the abandoned steps' weights cannot be told apart by version; their groups are accounted by
the surviving cursor like any other.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
from typing import Any

import msgspec

from vime.queue.gc import WriterPublications, never_registered, never_started
from vime.queue.journal_view import JournalView
from vime.queue.tasks import AcceptedGroup, regenerated_id
from vime.recovery.lineage import Lineage

PROBLEMS_SHOWN = 5  # problems the text output lists (--json lists them all)
NO_PAYLOAD = "no payload on disk"  # the row of groups without a lineage: filtered, failed, unreadable


class Fate(enum.Enum):
    """What became of a generated group."""

    TRAINED = "trained"
    WAITING = "waiting"
    STALE = "stale"
    LOST_WITH_LINEAGE = "lost_with_lineage"
    FILTERED = "filtered"
    FAILED = "failed"
    RELEASED_ORPHAN = "released_orphan"
    UNACCOUNTED = "unaccounted"  # generated, but neither trained, waiting nor discarded for a cause on disk


DISCARDS = (Fate.STALE, Fate.LOST_WITH_LINEAGE, Fate.FILTERED, Fate.FAILED, Fate.RELEASED_ORPHAN)
IN_FLIGHT_STAGES = ("fresh", "leased", "continuation")  # queue_cli's task stages that generated nothing yet


@dataclasses.dataclass(frozen=True)
class SurvivingLineage:
    """The lineage that survives, as the latest checkpoint (or the queue's committed state) tells it."""

    step: int
    cursor: int  # accepted positions before it are done with
    step_cursors: list[int]  # the cursor after each step
    skipped: list[int]  # positions before the cursor not trained (too stale, lost versions)
    lineage: Lineage  # restores in place: which versions are lost
    source: str  # where it came from, for the reader


def surviving_lineage(data_dir: str, save: str | None, view: JournalView, run_id: str) -> SurvivingLineage:
    """The surviving lineage: the latest checkpoint in ``save`` if given (and there is one), else the
    queue's own committed consumer state, else nothing trained."""
    if save:
        from vime.recovery import checkpoint as ckpt

        if ckpt.latest_step(save) is not None:
            _, state = ckpt.load_state(save)
            return SurvivingLineage(
                state.step,
                state.consumer_cursor,
                list(state.step_cursors),
                list(state.skipped),
                state.lineage,
                f"checkpoint step {state.step} in {save}",
            )
    states = view.of_type("ConsumerState")
    if not states:
        return SurvivingLineage(0, 0, [], [], Lineage(), "nothing trained")
    response = states[-1]["response"]
    from straw import RecordSetRef

    from vime.queue.rollout_queue import open_store

    store = open_store(data_dir, run_id)
    try:
        payload = json.loads(next(store.read(RecordSetRef.from_dict(response["state_ref"]))).payload)
    finally:
        store.close()
    # "lineage": written by controllers since the ledger; older commits carry none (no restore known)
    lineage = msgspec.convert(payload.get("lineage") or {}, Lineage)
    return SurvivingLineage(
        payload.get("step", len(payload.get("step_cursors", []))),
        response["processed_cursor"],
        payload.get("step_cursors", []),
        payload.get("skipped", []),
        lineage,
        "the queue's committed cursor",
    )


@dataclasses.dataclass(frozen=True)
class GroupFacts:
    """What a group's payload says, read from its sample headers only (no tensors)."""

    tokens: int  # response tokens
    versions: frozenset[int]  # weight versions of those tokens


def publication_owner(store, ref) -> tuple[str | None, str | None]:
    """The (task id, attempt id) that published the group at ``ref`` (every record carries them); (None, None)
    when its payload was reclaimed or is unreadable."""
    from straw.errors import QueueError

    try:
        metadata = next(iter(store.read(ref))).metadata
    except (QueueError, OSError, StopIteration):
        return None, None
    return metadata.get("task_id"), metadata.get("attempt_id")


def read_facts(store, ref) -> GroupFacts | None:
    """The facts of the group at ``ref``; None when its payload was reclaimed or is unreadable."""
    from straw.errors import QueueError

    from vime.queue.records import sample_headers

    try:
        headers = sample_headers(store.read(ref))
    except (QueueError, OSError):  # (CorruptData is a QueueError)
        return None
    if not headers:
        return None
    return GroupFacts(
        sum(h.response_length for h in headers),
        frozenset(version for h in headers for version, _, _ in h.version_segments),
    )


@dataclasses.dataclass(frozen=True)
class LineageSpan:
    """One lineage of the run: the weights from ``first_version`` on, until the next restore."""

    index: int
    first_version: int
    restored_step: int | None  # the checkpoint step its trainer was restored from; None: the run's start
    lost: tuple[int, int] | None  # its versions a later restore threw away (inclusive range)

    def describe(self) -> str:
        start = "run start" if self.restored_step is None else f"from step {self.restored_step}"
        lost = f", v{self.lost[0]}..{self.lost[1]} lost" if self.lost else ""
        return f"lineage {self.index} ({start}, v{self.first_version}+{lost})"


def lineage_spans(lineage: Lineage) -> list[LineageSpan]:
    firsts = [0, *(r.version for r in lineage.restores)]
    steps: list[int | None] = [None, *(r.step for r in lineage.restores)]
    spans = []
    for index, first in enumerate(firsts):
        lost = None
        if index < len(lineage.restores):
            restore = lineage.restores[index]
            low, high = max(first, restore.lost_after + 1), restore.version - 1
            lost = (low, high) if low <= high else None
        spans.append(LineageSpan(index, first, steps[index], lost))
    return spans


@dataclasses.dataclass
class Row:
    """One line of the ledger: groups and response tokens per fate."""

    groups: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    tokens_unknown: int = 0  # groups counted whose tokens are not on disk

    def add(self, fate: Fate, facts: GroupFacts | None, *, generated: bool = True) -> None:
        self.groups[fate] += 1
        if generated:
            self.groups["generated"] += 1
        if facts is None:
            self.tokens_unknown += 1
        else:
            self.tokens[fate] += facts.tokens
            if generated:
                self.tokens["generated"] += facts.tokens

    def to_json(self) -> dict[str, Any]:
        def flat(counts: collections.Counter) -> dict[str, int]:
            out = {
                "generated": counts["generated"],
                "trained": counts[Fate.TRAINED],
                "waiting": counts[Fate.WAITING],
                "discarded": sum(counts[f] for f in DISCARDS),
            }
            out.update({f.value: counts[f] for f in DISCARDS})
            out["unaccounted"] = counts[Fate.UNACCOUNTED]
            return out

        groups = flat(self.groups)
        return {
            "groups": groups,
            "tokens": flat(self.tokens),
            "tokens_unknown": self.tokens_unknown,
            "balance": groups["generated"] - groups["trained"] - groups["waiting"] - groups["discarded"],
        }


def compute(
    view: JournalView, stages: dict[str, str], survivor: SurvivingLineage, store, *, data_dir: str
) -> dict[str, Any]:
    """The ledger (a JSON-ready dict) of the queue in ``data_dir`` whose journal is ``view``; ``stages``:
    every task's stage as `vime queue inspect` replays it; ``store``: a straw store handle to read payloads
    and publication receipts with (nothing is written)."""
    from straw.errors import WriterBusy

    lineage, cursor = survivor.lineage, survivor.cursor
    spans = lineage_spans(lineage)
    skipped = set(survivor.skipped)
    submitted = {task["task_id"]: task.get("metadata") or {} for e in view.of_type("Submitted") for task in e["tasks"]}
    run, rows, no_payload = Row(), {span.index: Row() for span in spans}, Row()
    problems: list[str] = []

    def row_of(facts: GroupFacts | None) -> Row:
        if facts is None or not facts.versions:
            return no_payload
        newest = max(facts.versions)
        return rows[max(span.index for span in spans if span.first_version <= newest)]

    def count(fate: Fate, facts: GroupFacts | None) -> None:
        run.add(fate, facts)
        row_of(facts).add(fate, facts)

    # --- accepted groups: trained, waiting, or skipped and regenerated (stale, lost with a lineage)
    accepted: list[AcceptedGroup] = view.accepted()
    trained_keys: collections.Counter = collections.Counter()
    for group in accepted:
        facts = read_facts(store, group.ref)
        regenerated = regenerated_id(group.position) in submitted
        if group.position < cursor and group.position not in skipped:
            fate = Fate.TRAINED
            metadata = submitted.get(group.task_id, {})
            trained_keys[metadata.get("group_index", group.task_id)] += 1
            if regenerated:
                problems.append(
                    f"position {group.position} ({group.task_id}): trained, but its prompt was submitted "
                    f"again as {regenerated_id(group.position)}: it would be trained twice"
                )
        elif group.position in skipped or regenerated:
            if not regenerated:
                fate = Fate.UNACCOUNTED
                problems.append(
                    f"position {group.position} ({group.task_id}): skipped by the surviving lineage, "
                    f"but its prompt was never submitted again ({regenerated_id(group.position)}): lost"
                )
            elif facts is not None and any(lineage.lost(v) for v in facts.versions):
                fate = Fate.LOST_WITH_LINEAGE
            else:
                fate = Fate.STALE
        else:
            fate = Fate.WAITING
        count(fate, facts)

    # --- trained positions the journal never accepted: counted trained, generated by nobody
    positions = {g.position for g in accepted}
    phantom = [p for p in range(cursor) if p not in skipped and p not in positions]
    for position in phantom[:PROBLEMS_SHOWN]:
        problems.append(
            f"position {position}: before the surviving lineage's cursor ({cursor}) and not skipped, "
            "but the queue never accepted a group there"
        )
    for _ in phantom:
        run.add(Fate.TRAINED, None, generated=False)
        no_payload.add(Fate.TRAINED, None, generated=False)
    ghosts = sorted(p for p in skipped if p >= cursor)
    if ghosts:
        problems.append(f"positions {ghosts[:PROBLEMS_SHOWN]}: skipped, but at or after the cursor ({cursor})")
    steps = survivor.step_cursors
    if steps != sorted(steps) or (steps and steps[-1] != cursor):
        problems.append(f"the step cursors {steps[-PROBLEMS_SHOWN:]} do not rise to the cursor ({cursor})")

    # --- tasks that ended without a group in the queue: filtered by the dynamic filter, failed
    in_flight = 0
    for stage in stages.values():
        if stage == "rejected":
            count(Fate.FILTERED, None)
        elif stage in ("failed", "retried"):
            count(Fate.FAILED, None)
        elif stage in IN_FLIGHT_STAGES:
            in_flight += 1

    # --- released orphans: group payloads published under an attempt the queue never accepted
    publications = WriterPublications.of(view)
    current = {lease["task_id"]: lease["attempt_id"] for e in view.of_type("Leased") for lease in e["leases"]}
    # Attempts still on: a group they published may yet be accepted.
    still_on = frozenset((t, current[t]) for t, stage in stages.items() if stage == "leased" and t in current)
    unchecked = 0
    for writer, attempts in publications.attempts.items():
        if never_registered(data_dir, writer) or never_started(data_dir, writer):
            continue  # a writer killed before its first publication, or while creating its journal: nothing
        try:
            orphans = publications.unadopted(store, writer, deadline=0.0, continuations=False, still_on=still_on)
        except WriterBusy:  # publishing right now (a live run): its attempts are still in flight
            unchecked += sum(a.key not in publications.accepted_at for a in attempts)
            continue
        for ref in orphans:
            if still_on and publication_owner(store, ref) in still_on:  # (a stopped run has none: no read)
                continue  # published beside a group looked for, by an attempt still on
            count(Fate.RELEASED_ORPHAN, read_facts(store, ref))

    trained_twice = {str(key): n - 1 for key, n in trained_keys.items() if n > 1}
    report = run.to_json()
    closes = report["balance"] == 0 and not trained_twice and not problems
    return {
        "unit": "groups; tokens are response tokens of the groups whose payload is on disk",
        "lineage": survivor.source,
        "closes": closes,
        "run": report,
        "lineages": [
            {
                "lineage": span.index,
                "first_version": span.first_version,
                "restored_step": span.restored_step,
                "lost_versions": list(span.lost) if span.lost else None,
                "describe": span.describe(),
                **rows[span.index].to_json(),
            }
            for span in spans
        ]
        + [{"lineage": None, "describe": NO_PAYLOAD, **no_payload.to_json()}],
        "trained_twice": sum(trained_twice.values()),
        "trained_twice_groups": trained_twice,  # group_index -> extra times trained
        "phantom_trained": len(phantom),
        "in_flight": in_flight,
        "attempts_unchecked": unchecked,
        "problems": problems,
    }


COLUMNS = (
    "generated",
    "trained",
    "waiting",
    "stale",
    "lost_with_lineage",
    "filtered",
    "failed",
    "released_orphan",
    "unaccounted",
)
HEADINGS = ("generated", "trained", "waiting", "stale", "lost", "filtered", "failed", "orphan", "unaccounted")


def format_ledger(ledger: dict[str, Any]) -> list[str]:
    """The ledger as text: a table (the whole run, then per lineage), then whether it closes."""
    rows = [("whole run", ledger["run"])] + [
        (row["describe"], row) for row in ledger["lineages"] if row["groups"]["generated"] or row["groups"]["trained"]
    ]
    label = max(len(name) for name, _ in rows) + 2
    widths = [len(h) + 2 for h in HEADINGS]
    lines = [
        "  ledger (groups; tokens: their response tokens, where the payload is on disk)",
        "    " + " " * label + "".join(f"{h:>{w}}" for h, w in zip(HEADINGS, widths)),
    ]
    for name, row in rows:
        lines.append(f"    {name:<{label}}" + "".join(f"{row['groups'][c]:>{w}}" for c, w in zip(COLUMNS, widths)))
        unknown = f"  ({row['tokens_unknown']} group(s) without tokens on disk)" if row["tokens_unknown"] else ""
        lines.append(
            f"    {'  tokens':<{label}}"
            + "".join(f"{row['tokens'][c]:>{w}}" for c, w in zip(COLUMNS, widths))
            + unknown
        )
    run = ledger["run"]["groups"]
    equation = (
        f"{run['generated']} generated = {run['trained']} trained + {run['waiting']} waiting + "
        f"{run['discarded']} discarded"
    )
    if ledger["closes"]:
        lines.append(f"  ledger closes: {equation}; none trained twice ({ledger['in_flight']} task(s) in flight)")
        return lines
    balance = ledger["run"]["balance"]
    why = []
    if balance > 0:
        why.append(f"{balance} groups unaccounted for")
    elif balance < 0:
        why.append(f"{-balance} more groups accounted for than generated")
    if ledger["trained_twice"]:
        why.append(f"{ledger['trained_twice']} groups trained twice in the surviving lineage")
    lines.append(f"  ledger does NOT close: {'; '.join(why) or 'the lineage state is inconsistent'} ({equation})")
    for problem in ledger["problems"][:PROBLEMS_SHOWN]:
        lines.append(f"    {problem}")
    if len(ledger["problems"]) > PROBLEMS_SHOWN:
        lines.append(f"    ... and {len(ledger['problems']) - PROBLEMS_SHOWN} more (--json lists them all)")
    return lines
