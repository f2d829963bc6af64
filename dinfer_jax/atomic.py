"""Atomic output folders: write into a temporary sibling, rename into place when complete.

    with atomic_folder(dst, overwrite=False) as tmp:
        ... write every file under tmp ...

`dst` keeps its old content or gets the complete new one; a non-empty `dst` is refused unless
`overwrite` (replaced whole). `sigint_deferred()` holds Ctrl-C until the current step ends.
Details: docs/internals/runtime.md.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import tempfile
import threading

TMP_TAG = ".dinfer-tmp-"


def _umask() -> int:
    """The process umask (read from /proc where it can be: os.umask alone must set it to read it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: str, name: str):
    prefix = f".{name}{TMP_TAG}"
    for entry in os.listdir(parent):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def check_destination(dst: str, overwrite: bool = False):
    """FileExistsError for a non-empty destination (unless overwrite) or a file in its place."""
    if os.path.isdir(dst):
        if os.listdir(dst) and not overwrite:
            raise FileExistsError(f"{dst}: destination exists and is not empty (pass --overwrite to replace it)")
    elif os.path.lexists(dst):
        raise FileExistsError(f"{dst}: destination exists and is not a folder")
    else:
        up = os.path.dirname(os.path.abspath(dst))
        while not os.path.exists(up):
            up = os.path.dirname(up)
        if not os.path.isdir(up):
            raise NotADirectoryError(f"{dst}: cannot be created, {up} is a file (Not a directory)")


@contextlib.contextmanager
def atomic_folder(dst: str, overwrite: bool = False):
    """Yield a fresh temporary sibling of `dst`; on success it becomes `dst` (module doc)."""
    dst = os.path.abspath(dst)
    parent, name = os.path.dirname(dst), os.path.basename(dst)
    check_destination(dst, overwrite)
    os.makedirs(parent, exist_ok=True)
    _remove_stale(parent, name)
    tmp = tempfile.mkdtemp(prefix=f".{name}{TMP_TAG}{os.getpid()}-", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; the result is an ordinary folder
    try:
        yield tmp
        check_destination(dst, overwrite)  # nobody filled it meanwhile
        with sigint_deferred():  # the renames complete together
            if os.path.isdir(dst) and os.listdir(dst):
                if not _exchange(tmp, dst):  # no atomic exchange here: a short window without dst
                    old = tempfile.mkdtemp(prefix=f".{name}{TMP_TAG}{os.getpid()}-old-", dir=parent)
                    os.rename(dst, os.path.join(old, "d"))
                    os.rename(tmp, dst)
                    tmp = old
            else:
                if os.path.isdir(dst):
                    os.rmdir(dst)  # an empty folder the user made
                os.rename(tmp, dst)
                tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def sigint_deferred():
    """A SIGINT during the block is raised as KeyboardInterrupt when the block ends (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got = []
    old = signal.signal(signal.SIGINT, lambda *_: got.append(1))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if got:
        raise KeyboardInterrupt
