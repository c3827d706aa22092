"""kernels/cpu_extension.py's build bookkeeping: stale build locks, per-checkout build directories, the cache's root."""

from __future__ import annotations

import os
import time

from iterserve.kernels import cpu_extension


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    lock.touch()
    cpu_extension._clear_stale_lock(lock)
    assert lock.exists()  # a build may be running right now
    old = time.time() - cpu_extension.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    cpu_extension._clear_stale_lock(lock)
    assert not lock.exists() and "stale build lock" in caplog.text
    cpu_extension._clear_stale_lock(lock)  # none: nothing to do


def test_the_build_directory_depends_on_where_the_sources_are(monkeypatch, tmp_path):
    here = cpu_extension._sources_tag()
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in cpu_extension.CSRC.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(cpu_extension, "CSRC", copy)
    assert cpu_extension._sources_tag() != here  # same sources, another checkout: its own build
    assert cpu_extension._sources_tag() == cpu_extension._sources_tag()


def test_the_cache_is_under_xdg_cache_home_where_it_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cpu_extension.cache_root() == tmp_path / "home" / ".cache" / "iterserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert cpu_extension.cache_root() == tmp_path / "cache" / "iterserve"
