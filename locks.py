"""Who may use a save directory at once (docs/checkpoints.md §4). One run saves into it, holding DIR/.lock (hold).
Readers (--load of a run that is still saving, --eval-only, export-hf) read its steps meanwhile: each pins the step
it reads (pin) until it is done (unpin), and --keep-last pruning (prune) deletes only steps no reader pins, each
renamed aside first, so a reader sees a step whole or not at all. Each is a flock: the kernel drops one when its
process ends, however it ends (SIGKILL too), so no crashed run or reader leaves one behind.
"""
import errno
import fcntl
import os
import shutil
import socket
import time

LOCK_NAME, PRUNING = ".lock", ".pruning."   # DIR/.pruning.step_N: a step being deleted (prune)
# flock errors of file systems that have none (Lustre mounted without flock), or none for a descriptor such as a
# directory's, open for reading only (EBADF: an exclusive lock emulated as a POSIX write lock)
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EBADF)


class Hold:
    """A save directory held by this process (flock on DIR/.lock, whose text names the holder). release() removes
    the file, then drops the lock (in that order: a run that opened the file meanwhile finds it unlinked and takes
    a new one), then the empty directories hold() created (`made`, deepest first): a refused run leaves none."""

    def __init__(self, path, fd, made):
        self.path, self.fd, self.made = path, fd, made

    def release(self):
        if self.fd is None:   # released already
            return
        if _same_file(self.fd, self.path):
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None
        for d in self.made:
            try:
                os.rmdir(d)   # only an empty one
            except OSError:
                break


def hold(root, command):
    """Hold save directory `root` for this run (global rank 0, before anything there is read or written), creating
    it -> Hold; `command`: the line, named to a run it refuses."""
    path, made = os.path.join(root, LOCK_NAME), []
    try:
        while True:
            made = sorted(set(made + _makedirs(root)), key=len, reverse=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:   # removed by a run that had created it and was refused meanwhile
                continue
            locked = _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if locked is False:
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "its holder is starting"
                os.close(fd)
                raise SystemExit(f"--save {root} is in use by another run ({holder}). Wait for it to end, or "
                                 "choose another --save")
            if locked is not True:
                print(f"--save {root}: its file system does not lock files ({locked}): a second run on it would not "
                      "be refused", flush=True)
                break
            if _same_file(fd, path):
                break
            os.close(fd)   # released by its holder after we opened it: take the file that is there now
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n".encode())
        return Hold(path, fd, made)
    except OSError as e:
        raise SystemExit(unwritable(root, 0, e)) from None


def _makedirs(root):
    """os.makedirs(root, exist_ok=True) -> the directories it created (none that another process did meanwhile)."""
    todo, d = [], os.path.abspath(root)
    while not os.path.lexists(d):
        todo.append(d)
        d = os.path.dirname(d)
    made = []
    for d in reversed(todo):
        try:
            os.mkdir(d)
            made.append(d)
        except FileExistsError:
            pass
    os.makedirs(root, exist_ok=True)   # what is in the way (a file, a dangling link) raises as it did
    return made


def _same_file(fd, path):
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def unwritable(root, rank, e):
    return f"--save {root}: rank {rank} cannot write there ({type(e).__name__}: {e.strerror or e}); give a " \
           "writable directory (every rank writes into it)"


# ---------------------------------------------------------------- readers of a live save directory

_pins = {}   # step directory -> the descriptor this process holds its shared flock on


def pin(step_dir):
    """A shared flock on step directory `step_dir` until unpin(): prune() leaves the step to a later save meanwhile.
    -> False when the step was pruned before the lock (gone, or renamed aside): the caller chooses again."""
    if step_dir in _pins:
        return True
    try:
        fd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    if _lock(fd, fcntl.LOCK_SH) and _same_file(fd, step_dir):
        _pins[step_dir] = fd
        return True
    os.close(fd)
    return False


def unpin():
    """Drop this process's pins (its reads are done)."""
    for fd in _pins.values():
        os.close(fd)
    _pins.clear()


def prune(root, names):
    """Delete the step directories `names` of save directory `root` (--keep-last): each renamed aside under an
    exclusive flock, so a reader never finds a step half deleted; one a reader pins is left to a later save."""
    for name in os.listdir(root):   # left by a prune that was killed midway
        if name.startswith(PRUNING):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for name in names:
        path, aside = os.path.join(root, name), os.path.join(root, PRUNING + name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            if not _lock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB):
                continue
            os.rename(path, aside)
        except OSError:   # pruning never fails a save: the step stays for the next one
            continue
        finally:
            os.close(fd)
        shutil.rmtree(aside, ignore_errors=True)


def _lock(fd, how):
    """flock(fd, how) -> True when locked, False when another process holds it (LOCK_NB), the error's text on a
    file system without locks (true too: nothing to wait for)."""
    try:
        fcntl.flock(fd, how)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return False
        if e.errno not in NO_LOCKS:
            raise
        return e.strerror or str(e)
    return True
