"""Host memory room from /proc and cgroup v2 files, over a tree laid out as the kernel does.

A poll asks for every kernel inside one ``one_moment()``, which reads each file and works out
each cgroup once: kernels in different cgroups must still get their own cgroup's room, and
the next moment must read the files again."""

from __future__ import annotations

from pathlib import Path

from jupyter_gpushare.core.hostmem import HostMemory

MiB = 1 << 20


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc).mkdir()
    (proc / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 4194304 kB\n")
    (cg / "users" / "alice").mkdir(parents=True)
    (cg / "users" / "bob").mkdir(parents=True)
    (cg / "cgroup.controllers").write_text("memory\n")
    for pid, group in ((101, "alice"), (102, "alice"), (201, "bob"), (301, None)):
        (proc / str(pid)).mkdir()
        (proc / str(pid) / "cgroup").write_text(f"0::/users/{group}\n" if group else "0::/\n")
    _limit(cg / "users" / "alice", limit=1024 * MiB, used=600 * MiB, inactive=100 * MiB)
    _limit(cg / "users" / "bob", limit=2048 * MiB, used=2000 * MiB, inactive=0)
    (cg / "users" / "memory.max").write_text("max\n")
    (cg / "users" / "memory.current").write_text(f"{2600 * MiB}\n")
    (cg / "users" / "memory.stat").write_text("anon 1\ninactive_file 0\n")
    return proc, cg


def _limit(d: Path, limit: int, used: int, inactive: int) -> None:
    (d / "memory.max").write_text(f"{limit}\n")
    (d / "memory.current").write_text(f"{used}\n")
    (d / "memory.stat").write_text(f"anon {used}\nfile 5\ninactive_file {inactive}\nactive_file 7\n")


def test_each_kernel_gets_its_own_cgroups_room_within_one_moment(tmp_path: Path) -> None:
    proc, cg = _tree(tmp_path)
    hm = HostMemory(proc=str(proc), cgroup_root=str(cg))
    with hm.one_moment():
        rooms = {pid: hm.room(pid) for pid in (101, 201, 102, 301, None)}
    # alice: 1024 - (600 - 100 inactive page cache) = 524 MiB, tighter than the machine's 4 GiB
    assert rooms[101].available == 524 * MiB and rooms[101].scope.endswith("users/alice")
    assert rooms[102].available == 524 * MiB  # the same cgroup, worked out once
    assert rooms[201].available == 48 * MiB and rooms[201].scope.endswith("users/bob")
    assert rooms[301].available == 4 * 1024 * MiB and rooms[301].scope == "machine"
    assert rooms[None].available == 4 * 1024 * MiB


def test_the_next_moment_reads_the_files_again(tmp_path: Path) -> None:
    proc, cg = _tree(tmp_path)
    hm = HostMemory(proc=str(proc), cgroup_root=str(cg))
    with hm.one_moment():
        assert hm.room(101).available == 524 * MiB
        _limit(cg / "users" / "alice", limit=1024 * MiB, used=900 * MiB, inactive=0)
        assert hm.room(102).available == 524 * MiB  # one moment: one reading
    with hm.one_moment():
        assert hm.room(102).available == 124 * MiB
    (proc / "meminfo").write_text("MemAvailable: 1024 kB\n")
    assert hm.room(301).available == 1024 * 1024  # outside a moment: read each time
