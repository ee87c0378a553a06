"""Who may use a save directory at once (docs/checkpoints.md §4): one run saves into it, holding DIR/.lock (hold).
A flock: the kernel drops it when its process ends, however it ends (SIGKILL too), so no crashed run leaves one
behind."""
import errno
import fcntl
import os
import socket
import time

LOCK_NAME = ".lock"


class Hold:
    """A save directory held by this process: flock on DIR/.lock, which the kernel drops when the process ends,
    however it ends (SIGKILL too), so no crashed run leaves it behind. The file names the holder for the run it
    refuses. release() removes the file, then drops the lock (in that order: a run that opened the file meanwhile
    finds it unlinked and takes a new one)."""

    def __init__(self, path, fd):
        self.path, self.fd = path, fd

    def release(self):
        if self.fd is None:   # released already
            return
        if _same_file(self.fd, self.path):
            os.remove(self.path)
        os.close(self.fd)
        self.fd = None


def hold(root, command):
    """Hold save directory `root` for this run (global rank 0, before anything there is read or written), creating
    it -> Hold; `command`: what the line that ran is, for a run it refuses. Held by another process: one line
    naming that holder."""
    path = os.path.join(root, LOCK_NAME)
    try:
        os.makedirs(root, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):   # e.g. Lustre mounted without flock
                    print(f"--save {root}: its file system does not lock files ({e.strerror}): a second run on it "
                          "would not be refused", flush=True)
                    break
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    raise
                holder = os.read(fd, 4096).decode(errors="replace").strip() or "its holder is starting"
                os.close(fd)
                raise SystemExit(f"--save {root} is in use by another run ({holder}). Wait for it to end, or "
                                 "choose another --save") from None
            if _same_file(fd, path):
                break
            os.close(fd)   # released by its holder after we opened it: take the file that is there now
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {command}\n".encode())
        return Hold(path, fd)
    except OSError as e:
        raise SystemExit(unwritable(root, 0, e)) from None


def _same_file(fd, path):
    try:
        a, b = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def unwritable(root, rank, e):
    return f"--save {root}: rank {rank} cannot write there ({type(e).__name__}: {e.strerror or e}); give a " \
           "writable directory (every rank writes into it)"
