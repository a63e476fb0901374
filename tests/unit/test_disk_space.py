"""The directories a run writes: tried at start-up (vime/preflight.py), their free space watched per step
(vime/recovery/disk_space.py)."""

from __future__ import annotations

import os
import shutil
import types

import pytest

from tests.tmpfs import mounted_tmpfs
from tests.train_args import minimal_train_argv
from vime import preflight
from vime.config import ConfigError, parse_train_args
from vime.recovery.disk_space import GB, FreeSpaceWatch, WatchedDirectory, watched_directories, why_unwritable


def leftovers(directory) -> list[str]:
    return [name for name in os.listdir(directory) if name.startswith(".vime-write-probe")]


# ----------------------------------------------------------------------------- tried at start-up
def test_a_writable_directory_passes_and_keeps_no_probe(tmp_path):
    assert why_unwritable(str(tmp_path)) is None
    assert why_unwritable(str(tmp_path / "not" / "yet")) is None
    assert not (tmp_path / "not").exists()  # creatable, not created: a later check may still refuse the run
    assert leftovers(tmp_path) == []


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert why_unwritable(str(tmp_path / "afile")) == "is not a directory"
    assert (
        why_unwritable(str(tmp_path / "afile" / "sub")) == f"cannot be created: {tmp_path / 'afile'} is not a directory"
    )


def test_a_read_only_mount_is_refused_even_for_root(tmp_path):
    with mounted_tmpfs(str(tmp_path / "ro"), size="1m", read_only=True) as ro:
        assert why_unwritable(ro) == "not writable (Read-only file system)"
        assert why_unwritable(os.path.join(ro, "save")) == f"cannot be created in {ro} (Read-only file system)"


def test_a_full_volume_is_refused(tmp_path):
    with mounted_tmpfs(str(tmp_path / "full"), size="1m") as full:
        with open(os.path.join(full, "filler"), "wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        assert why_unwritable(full).startswith("no space left on its volume")
        assert leftovers(full) == []


def test_the_run_refuses_its_unwritable_directories_naming_each_flag(tmp_path, config_dir):
    (tmp_path / "afile").write_text("x")
    with mounted_tmpfs(str(tmp_path / "ro"), size="1m", read_only=True) as ro:
        s = parse_train_args(
            minimal_train_argv(
                config_dir,
                "--save",
                f"{ro}/save",
                "--rollout-data-dir",
                str(tmp_path / "queue"),
                "--save-debug-rollout-data",
                str(tmp_path / "afile" / "debug" / "{rollout_id}.vdr"),
            )
        )
        with pytest.raises(preflight.DirectoriesUnusable) as caught:
            preflight.check_written_directories(s)
    assert str(caught.value).splitlines() == [
        "2 directories the run writes are unusable:",
        f"  --save {ro}/save: cannot be created in {ro} (Read-only file system)",
        f"  --save-debug-rollout-data {tmp_path}/afile/debug: cannot be created: {tmp_path}/afile is not a directory",
    ]


def test_one_path_given_to_several_flags_is_one_line(tmp_path, config_dir):
    with mounted_tmpfs(str(tmp_path / "ro"), size="1m", read_only=True) as ro:
        s = parse_train_args(
            minimal_train_argv(config_dir, "--save", ro, "--rollout-data-dir", str(tmp_path / "q"))
            + ["--run-dir", ro, "--update-weight-disk-dir", str(tmp_path / "w")]
        )
        with pytest.raises(preflight.DirectoriesUnusable) as caught:
            preflight.check_written_directories(s)
    assert str(caught.value) == f"--save and --run-dir {ro}: not writable (Read-only file system)"


def test_every_directory_the_run_writes_is_checked(tmp_path, config_dir):
    roles = tmp_path / "roles.yaml"
    roles.write_text(f"megatron:\n  - role: critic\n    overrides:\n      save: {tmp_path / 'critic'}\n")
    s = parse_train_args(
        minimal_train_argv(
            config_dir,
            "--save",
            str(tmp_path / "save"),
            "--save-debug-rollout-data",
            str(tmp_path / "debug" / "step{rollout_id}" / "batch.vdr"),
            "--advantage-estimator",
            "ppo",
            "--megatron-config-path",
            str(roles),
        )
    )
    assert dict(preflight.written_directories(s)) == {
        "--save": str(tmp_path / "save"),
        "--rollout-data-dir": str(tmp_path / "save" / "rollout_data"),
        "--run-dir": "/tmp/vime-test-run",
        "--update-weight-disk-dir": "/tmp/vime-test-run/weights",
        "--save-debug-rollout-data": str(tmp_path / "debug"),
        f"--megatron-config-path {roles} (the critic's save)": str(tmp_path / "critic"),
    }
    preflight.check_written_directories(s)  # all writable: passes, creates nothing
    assert not (tmp_path / "save").exists()


def test_min_free_disk_gb_is_validated(config_dir):
    assert parse_train_args(minimal_train_argv(config_dir)).run.min_free_disk_gb == 5.0
    assert parse_train_args(minimal_train_argv(config_dir, "--min-free-disk-gb", "0")).run.min_free_disk_gb == 0
    with pytest.raises(ConfigError, match="--min-free-disk-gb: must be >= 0"):
        parse_train_args(minimal_train_argv(config_dir, "--min-free-disk-gb", "-1"))


# ----------------------------------------------------------------------------- watched while running
class FakeVolumes:
    """Directories on devices whose free space the test sets (stat's st_dev, statvfs's free blocks)."""

    def __init__(self, devices: dict[str, int]):
        self.device_of = devices  # path -> device
        self.free: dict[int, int] = {}  # device -> free bytes
        self.broken: set[str] = set()

    def stat(self, path):
        return types.SimpleNamespace(st_dev=self.device_of[path])

    def statvfs(self, path):
        if path in self.broken:
            raise OSError(5, "Input/output error")
        return types.SimpleNamespace(f_bavail=self.free[self.device_of[path]], f_frsize=1)


@pytest.fixture
def volumes(tmp_path):
    for name in ("queue", "save", "weights"):
        (tmp_path / name).mkdir()
    # The queue and the checkpoints share volume 1; the weights are on volume 2.
    fake = FakeVolumes({str(tmp_path / "queue"): 1, str(tmp_path / "save"): 1, str(tmp_path / "weights"): 2})
    fake.free = {1: int(10 * GB), 2: int(50 * GB)}
    return fake


def watch_of(tmp_path, volumes, said, min_free_gb=5.0) -> FreeSpaceWatch:
    directories = [
        WatchedDirectory("queue", "--rollout-data-dir", str(tmp_path / "queue"), ("--rollout-queue-online-gc (x)",)),
        WatchedDirectory("checkpoint", "--save", str(tmp_path / "save"), ("a larger --save-interval (y)",)),
        WatchedDirectory("weights", "--update-weight-disk-dir", str(tmp_path / "weights")),
    ]
    return FreeSpaceWatch(
        directories, min_free_bytes=min_free_gb * GB, say=said.append, statvfs=volumes.statvfs, stat=volumes.stat
    )


def test_free_space_and_bytes_per_step_are_recorded_per_directory(tmp_path, volumes):
    said = []
    watch = watch_of(tmp_path, volumes, said)
    volumes.free[1] -= int(0.4 * GB)  # two steps of 0.2 GB on the queue's volume
    watch.sample()
    volumes.free[1] -= int(0.2 * GB)
    record = watch.sample()
    assert record["disk_free_gb/queue"] == record["disk_free_gb/checkpoint"] == pytest.approx(9.4)
    assert record["disk_free_gb/weights"] == 50
    assert record["disk_bytes_per_step/queue"] == pytest.approx(0.3 * GB)
    assert record["disk_bytes_per_step/weights"] == 0
    assert said == []


def test_a_volume_below_the_threshold_warns_once_per_crossing(tmp_path, volumes):
    said = []
    watch = watch_of(tmp_path, volumes, said)
    for _ in range(3):  # 2 GB a step: 10 -> 8 -> 6 -> 4 (crossed)
        volumes.free[1] -= int(2 * GB)
        watch.sample()
    assert len(said) == 1
    warning = said[0]
    assert warning.startswith(
        f"low disk space: 4.00 GB free on the volume of --rollout-data-dir {tmp_path / 'queue'} and --save "
        f"{tmp_path / 'save'}, below --min-free-disk-gb 5; the run fills 2.0 GB per step there (measured over 3 "
        "step(s): room for about 2 more)"
    )
    assert "What would help: --rollout-queue-online-gc (x); a larger --save-interval (y); a bigger volume" in warning
    assert "--update-weight-disk-dir" not in warning  # its volume has room
    volumes.free[1] -= int(1 * GB)
    watch.sample()
    volumes.free[1] = int(5.1 * GB)  # back above, but within the margin: still the same crossing
    watch.sample()
    assert len(said) == 1
    volumes.free[1] = int(6 * GB)
    watch.sample()
    assert said[1] == (
        f"disk space recovered: 6.00 GB free on the volume of --rollout-data-dir {tmp_path / 'queue'} and --save "
        f"{tmp_path / 'save'}"
    )
    volumes.free[1] = int(3 * GB)
    watch.sample()
    assert len(said) == 3 and said[2].startswith("low disk space: 3.00 GB free")


def test_a_volume_low_from_the_start_warns_at_once(tmp_path, volumes):
    volumes.free[2] = int(1 * GB)
    said = []
    watch_of(tmp_path, volumes, said)
    assert len(said) == 1
    assert said[0].startswith(f"low disk space: 1.00 GB free on the volume of --update-weight-disk-dir {tmp_path}")
    assert "not measured yet" in said[0] and said[0].endswith("What would help: a bigger volume for these directories")


def test_zero_turns_the_warning_off_and_an_unreadable_volume_is_skipped(tmp_path, volumes):
    volumes.free[1] = int(1 * GB)
    said = []
    watch = watch_of(tmp_path, volumes, said, min_free_gb=0)
    volumes.broken.add(str(tmp_path / "weights"))
    record = watch.sample()
    assert said == []
    assert "disk_free_gb/weights" not in record and record["disk_free_gb/queue"] == 1


def test_a_directory_not_made_yet_is_sampled_on_its_nearest_ancestor(tmp_path):
    said = []
    watch = FreeSpaceWatch(
        [WatchedDirectory("checkpoint", "--save", str(tmp_path / "later" / "save"))], min_free_bytes=0, say=said.append
    )
    assert watch.sample()["disk_free_gb/checkpoint"] == pytest.approx(shutil.disk_usage(tmp_path).free / GB, rel=0.01)


def test_the_watched_directories_and_their_advice_follow_the_flags(tmp_path, config_dir):
    s = parse_train_args(minimal_train_argv(config_dir, "--save", str(tmp_path / "s"), "--save-interval", "5"))
    by_name = {d.name: d for d in watched_directories(s)}
    assert [(d.flag, d.path) for d in by_name.values()] == [
        ("--rollout-data-dir", str(tmp_path / "s" / "rollout_data")),
        ("--save", str(tmp_path / "s")),
        ("--update-weight-disk-dir", "/tmp/vime-test-run/weights"),
    ]
    assert by_name["queue"].advice[0].startswith("--rollout-queue-online-gc")
    assert (
        by_name["checkpoint"].advice[0]
        == "a larger --save-interval (now 5) or --save-retain-last K (now every iter_*/ is kept)"
    )
    assert by_name["weights"].advice == ("a smaller --keep-weight-versions (now 2)",)
    s = parse_train_args(
        minimal_train_argv(config_dir, "--rollout-queue-online-gc", "--rollout-data-transport", "straw")
    )
    assert watched_directories(s)[0].advice[0].startswith("a smaller --rollout-queue-segment-mib (now 64;")
    s = parse_train_args(minimal_train_argv(config_dir, "--rollout-data-transport", "object-store"))
    assert [d.name for d in watched_directories(s)] == ["weights"]
