"""File operations that survive a kill -9 (and a power loss) at any instruction.

New content goes to a temp file in the target's dir, is fsynced, and only then renamed into
place; every rename, link and unlink is followed by an fsync of the dirs it changed. A second
name for a file (the quarantine's copy of an original) is a hard link where the file system
allows one, else a verified copy: `rename` and `link` cannot cross file systems, and a cache dir
may hold mount points or symlinks to other disks. Renames, links and unlinks name their files by
(folder descriptor, name), the folders opened by confined.py: a folder swapped for a symlink
after it was opened cannot redirect them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os

# link() fails with these where the file system cannot give a file a second name here.
NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP})


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_new(path: str, data: bytes, like: os.stat_result | None = None, *,
              dir_fd: int | None = None) -> None:
    """Write `data` to a file that must not exist yet (`path` relative to `dir_fd` if given),
    fsynced. With `like`, the file gets its mode, owner and group (chown where permitted: an
    EPERM leaves the fixer's) and its access and modification times, so that a trainer
    comparing image and cache mtimes sees the rewritten entry exactly as fresh as before."""
    mode = (like.st_mode & 0o7777) if like is not None else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if like is not None:
            keep_attributes(fd, like)
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_attributes(fd: int, like: os.stat_result) -> None:
    """Give the open file `like`'s owner, group, mode and times (after the last write)."""
    if (like.st_uid, like.st_gid) != (os.getuid(), os.getgid()):
        try:
            os.fchown(fd, like.st_uid, like.st_gid)
        except PermissionError:
            with contextlib.suppress(PermissionError):  # a group member may still set the group
                os.fchown(fd, -1, like.st_gid)
    os.fchmod(fd, like.st_mode & 0o7777)  # after chown, which clears set-id bits
    os.utime(fd, ns=(like.st_atime_ns, like.st_mtime_ns))


def second_name_at(src_dir: int, name: str, dst_dir: int, dst_name: str, part: str) -> None:
    """Give `name`'s content the durable name `dst_name` and keep `name`: a hard link, or a
    copy (through `part`, with the original's mode, owner and times) where links cannot be made;
    both ends named by (folder fd, name)."""
    try:
        os.link(name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in NO_LINK:
            raise
        _copy_at(src_dir, name, dst_dir, dst_name, part)
    os.fsync(dst_dir)


def move_at(src_dir: int, name: str, dst_dir: int, dst_name: str, part: str) -> None:
    """Move `name` to `dst_name` durably (over it if it exists): a rename, or, across file
    systems, a copy through `part` renamed over `dst_name` and an unlink of `name` once the copy
    is on disk. Both ends are (folder fd, name): a swapped parent folder cannot redirect it."""
    try:
        os.rename(name, dst_name, src_dir_fd=src_dir, dst_dir_fd=dst_dir)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        _copy_at(src_dir, name, dst_dir, dst_name, part)
        os.fsync(dst_dir)
        os.unlink(name, dir_fd=src_dir)
    os.fsync(dst_dir)
    os.fsync(src_dir)


def link_new_at(dir_fd: int, src: str, dst: str) -> None:
    """Give `src` the name `dst` in one folder, failing if `dst` exists (a new cache entry
    never overwrites one), then drop the name `src`."""
    try:
        os.link(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in NO_LINK:
            raise
        try:
            os.stat(dst, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # the lock keeps other runs out
        else:
            raise FileExistsError(errno.EEXIST, "file exists", dst) from None
    else:
        os.unlink(src, dir_fd=dir_fd)
    os.fsync(dir_fd)


def _copy_at(src_dir: int, name: str, dst_dir: int, dst_name: str, part: str) -> None:
    """Copy (mode, owner and times kept, fsynced) to `part`, then rename it over `dst_name`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(part, dir_fd=dst_dir)  # ours, from an attempt that died
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dir)
    try:
        like = os.fstat(src)
        out = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o600, dir_fd=dst_dir)
        try:
            while chunk := os.read(src, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
            keep_attributes(out, like)
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(src)
    os.rename(part, dst_name, src_dir_fd=dst_dir, dst_dir_fd=dst_dir)


