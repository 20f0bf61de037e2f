"""Reach a cache's files through directory descriptors, never through a symlink.

Between the plan and the run, a sub-folder of the cache may be swapped for a symlink to a folder
elsewhere, or a file for a symlink to another file. A path resolved by the kernel would follow
either; here every folder is opened from the root's descriptor one component at a time with
O_NOFOLLOW | O_DIRECTORY, files are opened with O_NOFOLLOW relative to their folder's
descriptor, and renames and links name both ends by (folder fd, name). Whatever is swapped after
a folder was opened, its descriptor still names the folder inside the cache.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from cachedoctor.repair.errors import RepairError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Moved(RepairError):
    """A folder on the way to a planned file is no longer a folder inside the cache."""


class Gone(Moved):
    """A folder on the way is not there at all."""


@dataclass(frozen=True)
class FileId:
    """What a plan saw of a file: the run acts on it only while all four are unchanged."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def differs(self, st: os.stat_result) -> str | None:
        """Why `st` is not this file (None when it is)."""
        if not stat.S_ISREG(st.st_mode):
            return "is no longer a regular file"
        if (st.st_dev, st.st_ino) != (self.dev, self.ino):
            return "was replaced by another file"
        if st.st_size != self.size:
            return f"changed size ({self.size:,} B became {st.st_size:,} B)"
        if st.st_mtime_ns != self.mtime_ns:
            return "was modified"
        return None


def open_root(root: str) -> int:
    """The cache root's descriptor (the root itself as given: it is what the user named)."""
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir(root_fd: int, reldir: str, *, create: bool = False) -> int:
    """A descriptor of `reldir` (relative to the root), walked one component at a time without
    following a symlink; missing folders are made when `create` (cachedoctor's own state dirs
    only). Raises Moved when a component is a symlink or not a folder."""
    fd = os.dup(root_fd)
    walked = ""
    try:
        for part in [p for p in reldir.split(os.sep) if p not in ("", ".")]:
            if part == "..":
                raise Moved(f"{reldir}: leaves the cache")
            walked = os.path.join(walked, part)
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise Gone(f"{walked}/: the folder is gone") from None
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    os.fsync(fd)
                except FileExistsError:
                    pass
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Moved(f"{walked}/ is now a symlink or not a folder: it may lead out of "
                                "the cache") from None
                raise
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_file(dir_fd: int, name: str) -> int:
    """Open `name` in `dir_fd` for reading; OSError(ELOOP) if it is a symlink."""
    return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)


def read_fd(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 24):
        chunks.append(chunk)
    return b"".join(chunks)


def read_at(dir_fd: int, name: str) -> bytes:
    """Every byte of `name` in `dir_fd` (open_file's refusals apply)."""
    fd = open_file(dir_fd, name)
    try:
        return read_fd(fd)
    finally:
        os.close(fd)
