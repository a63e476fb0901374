"""Debug-replay archives: every field round-trips, archives are immutable, bad paths are named,
and a replay in this process (no Ray, no engine) reproduces the recorded metrics bit for bit."""

import dataclasses
import io
import json
import os

import numpy as np
import pytest
import torch

from tests.train_args import minimal_train_argv as argv
from vime.config import ConfigError, parse_train_args
from vime.metrics import MetricsLog
from vime.recovery import debug_archive as da
from vime.sample import Sample, Status


def full_sample(index: int = 0, *, reward=0.75) -> Sample:
    """A sample with every field set, optional captures in several dtypes, kinds and shapes."""
    generator = torch.Generator().manual_seed(index)
    return Sample(
        group_index=3,
        index=index,
        prompt_index=17,
        prompt=[{"role": "user", "content": "12="}],
        label=["23", 1],
        tokens=[1, 2, 11, 2, 3, 0],
        response="23",
        response_length=3,
        loss_mask=[1, 0, 1],
        reward=reward,
        status=Status.TRUNCATED,
        rollout_log_probs=[-0.1, -2.5e-8, -3.0000000001],
        weight_versions=[4, 4, 5],
        metadata={"source_name": "digits", "nested": {"a": [1, 2.5, None]}, "n": np.int64(7)},
        source="mix-a",
        session_id=f"g3-{index}",
        rollout_routed_experts=torch.randint(0, 255, (5, 2, 3), dtype=torch.uint8, generator=generator),
        rollout_topk_token_ids=torch.randint(0, 11, (3, 4), dtype=torch.int32, generator=generator),
        rollout_topk_log_probs=torch.randn((3, 4), generator=generator).to(torch.bfloat16),
        rollout_topp_ids=np.array([[1], [2], [3], [4]], dtype=np.int64),
        rollout_topp_offsets=[0, 1, 3, 4],
        rollout_topp_log_probs=torch.empty((0, 2), dtype=torch.float16),
    )


def assert_same_sample(a: Sample, b: Sample) -> None:
    for field in dataclasses.fields(Sample):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape, field.name
            assert torch.equal(x, y), field.name
        elif isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and y.dtype == x.dtype and y.shape == x.shape, field.name
            assert np.array_equal(x, y), field.name
        elif field.name == "metadata":
            assert json.dumps(x, default=int) == json.dumps(y), field.name  # numpy scalars become plain
        else:
            assert x == y and type(x) is type(y), (field.name, x, y)


def make_archive(rollout_id=0, policy_version=0, samples=None, metrics=None) -> da.DebugArchive:
    if samples is None:
        samples = [full_sample(0), full_sample(1, reward=None), full_sample(2, reward=1)]
    groups = [(10, "g000000010", samples[:2]), (11, "r000000004", samples[2:])]
    return da.build_archive(
        rollout_id=rollout_id,
        policy_version=policy_version,
        groups=groups,
        metrics=metrics or {"loss": 0.1 + 0.2, "grad_norm": 1.5, "tokens_per_version": {4: 6}},
        trainer={"lr": 1e-3, "adam_betas": (0.9, 0.999)},
        argv=["vime", "train"],
    )


def test_archive_round_trips_every_field(tmp_path):
    archive = make_archive(rollout_id=7, policy_version=6)
    path = str(tmp_path / "7.vdr")
    assert da.write_archive(path, archive) == "written"
    loaded = da.read_archive(path)
    assert (loaded.rollout_id, loaded.policy_version, loaded.argv) == (7, 6, ["vime", "train"])
    assert loaded.metrics == {"loss": 0.1 + 0.2, "grad_norm": 1.5, "tokens_per_version": {4: 6}}
    assert loaded.trainer == {"lr": 1e-3, "adam_betas": [0.9, 0.999]}
    assert [(g.position, g.task_id, g.size) for g in loaded.groups] == [(10, "g000000010", 2), (11, "r000000004", 1)]
    groups = loaded.grouped()
    assert [len(g) for g in groups] == [2, 1]
    originals = [full_sample(0), full_sample(1, reward=None), full_sample(2, reward=1)]
    for original, restored in zip(originals, [s for g in groups for s in g]):
        assert_same_sample(original, restored)
    assert os.listdir(tmp_path) == ["7.vdr"]  # no temporary file left behind


def test_resave_of_the_same_batch_is_kept_anything_else_is_refused(tmp_path):
    path = str(tmp_path / "debug" / "0.vdr")
    assert da.write_archive(path, make_archive()) == "written"
    before = open(path, "rb").read()
    # A resumed run retrains the step from the same groups: accepted, the file is left as it was.
    assert da.write_archive(path, make_archive(metrics={"loss": 9.0, "grad_norm": 9.0})) == "kept"
    other = [full_sample(0), full_sample(1, reward=None), full_sample(2, reward=0)]
    for archive, words in (
        (make_archive(samples=other), "other samples"),
        (make_archive(policy_version=3), "policy v0"),
        (make_archive(rollout_id=1), "rollout 0, not 1"),
    ):
        with pytest.raises(da.ArchiveExists) as error:
            da.write_archive(path, archive)
        message = str(error.value)
        assert message.startswith("--save-debug-rollout-data: ") and path in message and words in message
        assert isinstance(error.value, ConfigError)  # `vime train` prints it as one line
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path / "debug") == ["0.vdr"]


def test_unreadable_or_foreign_files_are_never_replaced(tmp_path):
    foreign = tmp_path / "0.vdr"
    foreign.write_bytes(b"someone else's file")
    with pytest.raises(da.ArchiveExists, match="not a readable archive"):
        da.write_archive(str(foreign), make_archive())
    assert foreign.read_bytes() == b"someone else's file"
    (tmp_path / "1.vdr").mkdir()
    with pytest.raises(da.ArchiveExists, match="not an archive file"):
        da.write_archive(str(tmp_path / "1.vdr"), make_archive(rollout_id=1))


def test_damaged_or_foreign_archives_are_refused_on_load(tmp_path):
    path = tmp_path / "0.vdr"
    da.write_archive(str(path), make_archive())
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(da.ArchiveError, match=r"^--load-debug-rollout-data: .*damaged"):
        da.read_archive(str(path))
    path.write_bytes(b"PK\x03\x04 not ours")
    with pytest.raises(da.ArchiveError, match="not a vime debug archive"):
        da.read_archive(str(path))
    with pytest.raises(da.ArchiveError, match="cannot read"):
        da.read_archive(str(tmp_path / "missing.vdr"))


def test_templates_and_archive_discovery(tmp_path, monkeypatch):
    for bad, words in (
        ("/d/batch.vdr", "must contain '{rollout_id}'"),
        ("/d/{rollout_id}-{step}.vdr", "does not format"),
        ("s3://bucket/{rollout_id}.vdr", "local or mounted"),
    ):
        with pytest.raises(ConfigError, match="^--save-debug-rollout-data: ") as error:
            da.check_template(bad, "--save-debug-rollout-data")
        assert words in str(error.value)
    folder = tmp_path / "dbg"
    for rollout_id in (0, 2, 11):
        da.write_archive(
            da.archive_path(str(folder / "step_{rollout_id:03d}.vdr"), rollout_id), make_archive(rollout_id=rollout_id)
        )
    (folder / "step_7.vdr").write_bytes(b"x")  # not what the template formats (007)
    (folder / ".step_005.vdr.tmp-1234").write_bytes(b"x")  # an interrupted write
    (folder / "notes.txt").write_text("x")
    found = da.existing_archives(str(folder / "step_{rollout_id:03d}.vdr"))
    assert found == {i: str(folder / f"step_{i:03d}.vdr") for i in (0, 2, 11)}
    monkeypatch.chdir(tmp_path)  # a relative template is relative to the working directory
    assert list(da.existing_archives("dbg/step_{rollout_id:03d}.vdr")) == [0, 2, 11]
    assert da.existing_archives("dbg/{rollout_id}.vdr") == {}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


def test_flags_are_validated_naming_them(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="^--save-debug-rollout-data: .*rollout_id"):
        parse_train_args(argv(model_dir, "--save-debug-rollout-data", str(tmp_path / "batch.vdr")))
    with pytest.raises(ConfigError, match="^--load-debug-rollout-data: no archive matches"):
        parse_train_args(argv(model_dir, "--load-debug-rollout-data", str(tmp_path / "{rollout_id}.vdr")))
    da.write_archive(str(tmp_path / "0.vdr"), make_archive())
    template = str(tmp_path / "{rollout_id}.vdr")
    with pytest.raises(ConfigError) as error:
        parse_train_args(argv(model_dir, "--load-debug-rollout-data", template, "--save-debug-rollout-data", template))
    message = str(error.value)
    assert message.startswith("--load-debug-rollout-data: ") and "--save-debug-rollout-data" in message
    settings = parse_train_args(argv(model_dir, "--load-debug-rollout-data", template))
    assert settings.debug.load_debug_rollout_data == template and settings.debug.save_debug_rollout_data is None


def test_debug_rollout_only_trains_no_batch_to_record_or_replay(model_dir, tmp_path):
    assert parse_train_args(argv(model_dir)).debug.debug_rollout_only is False
    assert parse_train_args(argv(model_dir, "--debug-rollout-only")).debug.debug_rollout_only is True
    da.write_archive(str(tmp_path / "0.vdr"), make_archive())
    template = str(tmp_path / "{rollout_id}.vdr")
    for flag in ("--save-debug-rollout-data", "--load-debug-rollout-data"):
        with pytest.raises(ConfigError, match=f"^--debug-rollout-only: cannot be combined with {flag} "):
            parse_train_args(argv(model_dir, "--debug-rollout-only", flag, template))


def test_every_optional_capture_is_archived_and_exported():
    from vime.queue.records import OPTIONAL_TENSORS
    from vime.tools.queue_export import EXPORT_TENSORS

    assert da.TENSOR_FIELDS == OPTIONAL_TENSORS == EXPORT_TENSORS
    # A field added to Sample must be added to the archive too (this fails until it is).
    archived = (set(da.ArchivedSample.__struct_fields__) - {"tensors"}) | set(OPTIONAL_TENSORS)
    assert archived == {f.name for f in dataclasses.fields(Sample)}


def test_metric_differences_are_bit_for_bit():
    recorded = {"loss": 0.1 + 0.2, "grad_norm": float("nan"), "train_seconds": 1.0, "per": {"1": [1.0, 2.0]}}
    assert da.metric_differences(recorded, {**recorded, "train_seconds": 2.0}) == []
    assert da.metric_differences(recorded, {**recorded, "loss": 0.3}) == ["loss"]
    assert da.metric_differences(recorded, {**recorded, "per": {"1": [1.0, 2.0000000000000004]}}) == ["per"]
    assert da.metric_differences(recorded, {"loss": recorded["loss"]}) == ["grad_norm", "per"]
    # A recording made on several trainer ranks summed in another order: compared within a tolerance.
    assert (
        da.metric_differences(
            recorded, {**recorded, "loss": 0.3, "per": {"1": [1.0, 2.0000000000000004]}}, rel_tol=1e-5
        )
        == []
    )
    assert da.metric_differences(recorded, {**recorded, "loss": 0.31}, rel_tol=1e-5) == ["loss"]


# ------------------------------------------------------------------ replay in this process
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from vime.tools.make_tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def digit_batch(rollout_id: int) -> list[tuple[int, str, list[Sample]]]:
    """Two groups of two samples (one right, one wrong answer) with sampler log-probs."""
    groups = []
    for g in range(2):
        prompt = [2 + rollout_id, 3 + g, 11]
        members = [
            Sample(
                group_index=2 * rollout_id + g,
                index=i,
                prompt_index=g,
                tokens=prompt + [4, 5 + i, 0],
                response_length=3,
                loss_mask=[1, 1, 1],
                reward=float(i == 0),
                status=Status.COMPLETED,
                rollout_log_probs=[-0.5, -1.25, -0.125],
                weight_versions=[rollout_id] * 3,
            )
            for i in range(2)
        ]
        groups.append((2 * rollout_id + g, f"g{2 * rollout_id + g:09d}", members))
    return groups


def record(settings, template: str, steps: int, save: str) -> list[dict]:
    """What `vime train --save-debug-rollout-data` records, made in this process (with a
    checkpoint after the first step in ``save``)."""
    from vime.recovery import checkpoint as ckpt
    from vime.replay import ReplayGroup, _replay_trainer_class, trainer_spec

    spec = trainer_spec(settings, 1)
    trainer = _replay_trainer_class()(spec)
    recorded = []
    for rollout_id in range(steps):
        batch = digit_batch(rollout_id)
        metrics = trainer.train_rollout(rollout_id, [ReplayGroup(p, t, m) for p, t, m in batch], rollout_id)
        archive = da.build_archive(
            rollout_id=rollout_id,
            policy_version=rollout_id,
            groups=batch,
            metrics=metrics,
            trainer=da.spec_as_dict(spec.backend),
            argv=[],
        )
        da.write_archive(da.archive_path(template, rollout_id), archive)
        recorded.append(metrics)
        if rollout_id == 0:
            state = ckpt.CheckpointState(schema=1, step=1, weight_version=1, consumer_cursor=2, run_options={})
            ckpt.save_checkpoint(save, state, trainer.save_checkpoint)
    trainer.shutdown()
    return recorded


def ckpt_steps(root: str) -> list[str]:
    return sorted(name for name in os.listdir(root) if name.startswith("iter_"))


def test_replay_reproduces_the_recording_without_any_engine(tiny_model, tmp_path):
    from vime.replay import replay

    template = str(tmp_path / "debug" / "{rollout_id}.vdr")
    flags = [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        "data.jsonl",
        "--rm-type",
        "exact_match",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--global-batch-size",
        "2",
        "--micro-batch-size",
        "1",
        "--lr",
        "1e-2",
        "--train-threads",
        "1",
        "--num-rollout",
        "5",
    ]
    save = str(tmp_path / "save")
    recorded = record(parse_train_args([*flags, "--run-dir", str(tmp_path / "rec")]), template, steps=3, save=save)
    assert all(m["grad_norm"] > 0 for m in recorded) and any(m["loss"] != 0 for m in recorded)

    settings = parse_train_args([*flags, "--run-dir", str(tmp_path / "replay"), "--load-debug-rollout-data", template])
    log = MetricsLog(settings.run_dir, stream=io.StringIO())
    assert replay(settings, log) == 0
    out = log.stream.getvalue()
    assert "warning" not in out and "stopping after 3 step(s)" in out and "bit for bit" in out
    rows = [json.loads(line) for line in open(tmp_path / "replay" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["replay_matches"] for r in rows)
    for row, metrics in zip(rows, recorded):
        assert (row["loss"], row["grad_norm"]) == (metrics["loss"], metrics["grad_norm"])
    assert json.load(open(tmp_path / "replay" / "replay.json"))["all_match"] is True

    # Other flags give other numbers, and the replay says so (it is not a test that cannot fail).
    settings = parse_train_args(
        [*flags, "--lr", "2e-2", "--run-dir", str(tmp_path / "other"), "--load-debug-rollout-data", template]
    )
    log = MetricsLog(settings.run_dir, stream=io.StringIO())
    replay(settings, log)
    out = log.stream.getvalue()
    assert "warning: the trainer differs from the recording (lr: 0.01 -> 0.02)" in out and "DIFFERS in" in out
    assert json.load(open(tmp_path / "other" / "replay.json"))["all_match"] is False

    # From a checkpoint: the steps after it, with the same numbers.
    settings = parse_train_args(
        [
            *flags,
            "--run-dir",
            str(tmp_path / "resumed"),
            "--load",
            save,
            "--save",
            save,
            "--load-debug-rollout-data",
            template,
        ]
    )
    log = MetricsLog(settings.run_dir, stream=io.StringIO())
    replay(settings, log)
    assert "--save is ignored" in log.stream.getvalue()
    rows = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [2, 3] and all(r["replay_matches"] for r in rows)
    assert [(r["loss"], r["grad_norm"]) for r in rows] == [(m["loss"], m["grad_norm"]) for m in recorded[1:]]
    assert ckpt_steps(save) == ["iter_0000001"]  # the replay wrote no checkpoint

    # --no-load-optim reaches the replay's trainer: a fresh AdamW steps otherwise than the recording (which kept
    # its optimizer), and the replay says so.
    fresh = [*flags, "--run-dir", str(tmp_path / "fresh"), "--load", save, "--no-load-optim"]
    settings = parse_train_args([*fresh, "--load-debug-rollout-data", template])
    replay(settings, MetricsLog(settings.run_dir, stream=io.StringIO()))
    rows = [json.loads(line) for line in open(tmp_path / "fresh" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [2, 3] and not all(r["replay_matches"] for r in rows)

    # A replay never writes into a run directory that holds metrics.
    settings = parse_train_args([*flags, "--run-dir", str(tmp_path / "replay"), "--load-debug-rollout-data", template])
    with pytest.raises(ConfigError, match="^--run-dir: .*already holds"):
        replay(settings, MetricsLog(settings.run_dir, stream=io.StringIO()))

    # The checkpoint's step has no archive: named, before anything is trained.
    os.unlink(da.archive_path(template, 1))
    settings = parse_train_args(
        [*flags, "--run-dir", str(tmp_path / "gap"), "--load", save, "--load-debug-rollout-data", template]
    )
    with pytest.raises(da.ArchiveError, match=r"^--load-debug-rollout-data: no archive for rollout 1 .*at step 2"):
        replay(settings, MetricsLog(settings.run_dir, stream=io.StringIO()))
