"""``vllm-router --help`` is asked once per installed binary and kept in the user's cache (vime/config/router.py)."""

from __future__ import annotations

import os
import stat

import pytest

from vime.config import router


@pytest.fixture
def fake_router(tmp_path, monkeypatch):
    """A script in place of vllm-router (its modification time can be changed here; the installed binary's must not
    be): it prints a help text and counts its calls."""
    calls = tmp_path / "calls"
    binary = tmp_path / "vllm-router"
    binary.write_text(f"#!/bin/sh\necho x >> {calls}\necho '  --policy {{round_robin,cache_aware}}  --port PORT'\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(router, "router_binary", lambda: str(binary))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    router.router_help.cache_clear()
    yield binary, lambda: len(calls.read_text().splitlines()) if calls.exists() else 0
    router.router_help.cache_clear()


def test_router_help_is_asked_once_per_binary(fake_router, tmp_path):
    binary, calls = fake_router
    assert router.flag_choices("policy") == ("round_robin", "cache_aware")
    assert calls() == 1 and len(os.listdir(tmp_path / "cache" / "vime")) == 1
    router.router_help.cache_clear()  # a new start
    assert router.router_flags() == {"policy", "port"} and calls() == 1  # from the cache
    os.utime(binary, ns=(0, binary.stat().st_mtime_ns + 10**9))  # the router reinstalled
    router.router_help.cache_clear()
    assert router.router_flags() == {"policy", "port"} and calls() == 2


def test_an_unwritable_cache_still_answers(fake_router, tmp_path, monkeypatch):
    _, calls = fake_router
    (tmp_path / "ro").write_text("")  # a file where the cache's folder would be
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro"))
    assert router.router_flags() == {"policy", "port"}
    router.router_help.cache_clear()
    assert router.router_flags() == {"policy", "port"} and calls() == 2
