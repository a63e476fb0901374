"""The JuiceFS mount check (queue/juicefs_mount.py) on parsed /proc/mounts lines and .config JSON, without a
mount: which settings are refused, how each refusal names its option, and what straw is told. The same checks
on a real mount: tests/integration/test_juicefs_volume.py."""

from __future__ import annotations

import json

import pytest

from vime.queue.juicefs_mount import (
    JuiceFSMountRefused,
    JuiceFSSettings,
    checked_declaration,
    mount_containing,
    parse_proc_mounts,
)

PROC_MOUNTS = """\
overlay / overlay rw,relatime,lowerdir=/l,upperdir=/u,workdir=/w 0 0
tmpfs /dev/shm tmpfs rw,relatime,size=24683664k 0 0
JuiceFS:jfs /shared fuse.juicefs rw,nosuid,nodev,relatime,user_id=0,group_id=0,default_permissions,allow_other 0 0
JuiceFS:two /mnt/with\\040space fuse.juicefs ro,nosuid,nodev,relatime,user_id=0,group_id=0 0 0
"""


def client_config(**changes) -> dict:
    """The .config of a JuiceFS 1.4.2 client mounted with the defaults (abridged to the fields read), changed."""
    config = {
        "Meta": {"OpenCache": 0, "ReadOnly": False},
        "Format": {"Name": "jfs", "Storage": "s3"},
        "Chunk": {"Writeback": False, "UploadDelay": 0},
        "Version": "1.4.2+2026-10-26.pypi",
        "AttrTimeout": 1_000_000_000,
        "DirEntryTimeout": 1_000_000_000,
        "NegEntryTimeout": 0,
        "EntryTimeout": 1_000_000_000,
        "ReaddirCache": False,
        "FuseOpts": {"Options": ["nonempty", "default_permissions"], "EnableLocks": True, "EnableWriteback": False},
    }
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = config
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def test_proc_mounts_lines_are_parsed_with_their_escapes():
    entries = parse_proc_mounts(PROC_MOUNTS)
    assert [e.mount_point for e in entries] == ["/", "/dev/shm", "/shared", "/mnt/with space"]
    assert entries[2].fs_type == "fuse.juicefs" and entries[2].source == "JuiceFS:jfs"
    assert entries[3].options[0] == "ro"


def test_the_mount_holding_a_path_is_the_deepest_even_before_the_path_exists():
    entries = parse_proc_mounts(PROC_MOUNTS)
    assert mount_containing("/shared/job/rollout_data", entries).mount_point == "/shared"
    assert mount_containing("/shared", entries).mount_point == "/shared"
    assert mount_containing("/sharedness/x", entries).mount_point == "/"  # a prefix of the name is not a parent
    assert mount_containing("/mnt/with space/q", entries).mount_point == "/mnt/with space"


def test_the_defaults_pass_and_are_what_straw_is_told():
    settings = JuiceFSSettings.from_config(client_config())
    assert settings.problems() == []
    assert settings.attr_cache_s == 1.0 and settings.open_cache_s == 0 and settings.version.startswith("1.4.2")


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"Chunk__Writeback": True}, "(--writeback)"),
        ({"Chunk__UploadDelay": 5_000_000_000}, "--upload-delay 5s"),
        ({"FuseOpts__EnableWriteback": True}, "-o writeback_cache"),
        ({"FuseOpts__Options": ["writeback_cache"]}, "-o writeback_cache"),
        ({"Meta__OpenCache": 2_000_000_000}, "(--open-cache 2s)"),
        ({"ReaddirCache": True}, "(--readdir-cache)"),
        ({"AttrTimeout": 30_000_000_000}, "--attr-cache 30s"),
        ({"EntryTimeout": 5_000_000_000}, "--entry-cache 5s"),
        ({"DirEntryTimeout": 2_000_000_000}, "--dir-entry-cache 2s"),
        ({"NegEntryTimeout": 1_000_000_000}, "--negative-entry-cache 1s"),
        ({"Meta__ReadOnly": True}, "(--read-only)"),
        ({"FuseOpts__EnableLocks": False}, "no file locks"),
        ({"Version": ""}, "no client version"),
    ],
)
def test_each_setting_that_breaks_the_queue_is_named_with_its_fix(changes, named):
    problems = JuiceFSSettings.from_config(client_config(**changes)).problems()
    assert len(problems) == 1 and named in problems[0], problems
    assert "remount" in problems[0] or "upgrade" in problems[0]


def test_shorter_caches_than_the_defaults_pass():
    config = client_config(AttrTimeout=0, EntryTimeout=500_000_000, DirEntryTimeout=0)
    assert JuiceFSSettings.from_config(config).problems() == []


def fake_mount(tmp_path, config: dict | None, fs_type: str = "fuse.juicefs", options: str = "rw,relatime") -> str:
    """A /proc/mounts of one JuiceFS mount at tmp_path/mnt, whose .config is ``config`` (None: hidden)."""
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    if config is not None:
        (mount_point / ".config").write_text(json.dumps(config))
    proc_mounts = tmp_path / "mounts"
    proc_mounts.write_text(f"overlay / overlay rw 0 0\nJuiceFS:jfs {mount_point} {fs_type} {options} 0 0\n")
    return str(proc_mounts)


def test_a_good_mount_gives_straws_declaration(tmp_path):
    proc_mounts = fake_mount(tmp_path, client_config())
    declaration = checked_declaration(str(tmp_path / "mnt" / "queue"), proc_mounts=proc_mounts)
    assert {k: declaration[k] for k in ("direct_mount", "writeback", "open_cache", "readdir_cache")} == {
        "direct_mount": True,
        "writeback": False,
        "open_cache": 0,
        "readdir_cache": False,
    }
    assert declaration["client_version"] == "1.4.2+2026-10-26.pypi"
    assert "JuiceFS volume jfs" in declaration["durability_description"]
    from straw.backend import FilesystemBackend

    FilesystemBackend(str(tmp_path / "mnt"), profile="juicefs", declaration=declaration)  # straw accepts it


def test_every_problem_of_a_mount_is_said_at_once(tmp_path):
    proc_mounts = fake_mount(tmp_path, client_config(Chunk__Writeback=True, Meta__OpenCache=10**9), options="ro")
    with pytest.raises(JuiceFSMountRefused) as refused:
        checked_declaration(str(tmp_path / "mnt" / "q"), proc_mounts=proc_mounts)
    lines = str(refused.value).splitlines()
    assert lines[0].startswith(f"--rollout-storage-profile juicefs: the JuiceFS mount at {tmp_path}/mnt")
    assert [line.split(" (")[0].split(":")[0].strip() for line in lines[1:]] == [
        f"{tmp_path}/mnt is mounted read-only",
        "write-back caching is on",
        "the open-file cache is on",
    ]


def test_a_directory_not_on_juicefs_is_refused_naming_what_it_is_on(tmp_path):
    proc_mounts = fake_mount(tmp_path, client_config(), fs_type="nfs4")
    with pytest.raises(JuiceFSMountRefused, match=r"is on a nfs4 file system .* mount the volume on this node"):
        checked_declaration(str(tmp_path / "mnt" / "q"), proc_mounts=proc_mounts)


def test_a_hidden_config_is_refused_naming_hide_internal(tmp_path):
    proc_mounts = fake_mount(tmp_path, None)
    with pytest.raises(JuiceFSMountRefused, match="remount without --hide-internal"):
        checked_declaration(str(tmp_path / "mnt" / "q"), proc_mounts=proc_mounts)


def test_an_explicit_declaration_is_checked_against_the_mount(tmp_path):
    proc_mounts = fake_mount(tmp_path, client_config())
    data_dir = str(tmp_path / "mnt" / "q")
    with pytest.raises(JuiceFSMountRefused, match=r"--rollout-storage-declaration says client_version='1.1.0'"):
        checked_declaration(data_dir, {"client_version": "1.1.0"}, proc_mounts=proc_mounts)
    agreeing = {"writeback": False, "open_cache": 0, "durability_description": "Redis AOF fsync always; S3"}
    declaration = checked_declaration(data_dir, agreeing, proc_mounts=proc_mounts)
    assert declaration["durability_description"] == "Redis AOF fsync always; S3"  # the operator's statement kept
