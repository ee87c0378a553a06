"""Nothing hangs, and one rank's failure ends the run (docs/parallel.md §9, docs/failures.md §2, §11).

The main thread marks where it is (mark: a new place; progress: still busy there). A daemon thread per rank beats
into the run's store: a sequence number, whether the main thread is overdue and where it waits, read off its stack.
An overdue rank looks at the others' beats; once every other rank is overdue too or has stopped beating, the run is
stuck: the first rank to claim the verdict prints the line, and every rank that sees it exits. A rank whose main()
fails claims the `failed` key (fail); every thread looks for it each TICK_S and ends its process, whatever its main
thread waits in (over NCCL a collective on the failed rank would wait for ever). A main thread blocked in a
collective runs no Python signal handler, so the C handler also writes the signal to a socket this thread reads
(signal.set_wakeup_fd), and ends the process where the graceful stop (failsafe.Stop) cannot come.
"""
import datetime
import json
import math
import multiprocessing
import os
import select
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

EXIT_STATUS = 3          # a stuck run (2: a user error, 128 + N: a signal)
FAILED_STATUS = 1        # a rank failed: it and every other rank exit with this
FIRST = 4                # set-up, the first step and the first evaluation of a process: this many timeouts
BACKSTOP_S = 3600.0      # torch's own process-group timeouts: the timeout plus this
TICK_S = 1.0             # how often the thread looks for a failed rank, a verdict and signals
HOLD_S = 3.0             # how long a failing rank that hosts the store keeps it for the others to read its line
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)   # a scheduler, Ctrl-C, a closed terminal / torchrun
HERE = os.path.dirname(os.path.abspath(__file__))
MINE = os.path.join(HERE, "watchdog.py")

_names = {}              # process group -> its label in messages (parallel.setup, failsafe.Stop)
_active = None           # this process's Watchdog, from start() (its thread ends with stop()); None on one rank
_state = ("set-up", time.monotonic(), True)   # where the watched thread is: (mark, since when, a first's allowance)


def name(group, label):
    _names[group] = label


def backstop(timeout):   # torch's own process-group timeouts end the run only if this thread cannot
    return datetime.timedelta(seconds=timeout + BACKSTOP_S)


def start(timeout, beat=None):
    """Watch this process (the calling thread, the main one, is the one watched); nothing to watch on one rank."""
    global _active
    stop()
    mark("set-up", first=True)
    _active = Watchdog(timeout, beat) if dist.get_world_size() > 1 else None


def stop():
    """The watched thread leaves main() (from a finally: sys.exc_info() holds its error, if any); by an error that
    another rank's end caused (a verdict, a failed rank), it exits as the watchdog would, quietly."""
    if _active is not None and not _active.done.is_set():
        signal.set_wakeup_fd(_active.old_wakeup)   # before the socket closes: its number may be reused
        _active.done.set()
        _active.wakeup_w.close()
        if sys.exc_info()[1] is not None:
            try:
                _active.ended()
            except Exception:   # no store: nothing to learn
                pass


def fail(line):
    """This rank's main() failed: tell the others -> whether this rank reports it (False: another failed first).
    Rank 0 of a run without torchrun's agent hosts the store: it keeps it until every rank is going."""
    if _active is None:
        return True
    store = _active.store
    try:
        store.set_timeout(datetime.timedelta(seconds=HOLD_S))
        first = store.compare_set("failed", "", line).decode() == line
        store.add("gone", 1)
        if _active.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            until = time.monotonic() + HOLD_S
            while store.add("gone", 0) < _active.world and time.monotonic() < until:
                time.sleep(0.05)
        return first
    except Exception:   # no store: nobody to tell
        return True


def leave(status, quiet=True):
    """Ends this process at once (os._exit: the interpreter's exit can hang), its DataLoader workers first (they
    look for it gone only every 5 s). quiet: what the dying main thread raises meanwhile goes to /dev/null."""
    try:
        for worker in multiprocessing.active_children():
            worker.kill()
    except Exception:   # the main thread changed them meanwhile: they end on their own
        pass
    if quiet:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    os._exit(status)


def mark(where, first=False):   # a first (set-up, step, evaluation) may take FIRST timeouts
    global _state
    _state = (where, time.monotonic(), first)


def progress():   # still busy at the same place (files written, tensors read)
    global _state
    _state = (_state[0], time.monotonic(), _state[2])


def where():   # 'step 3, micro-batch 2/4'
    return _state[0]


def raised_at(tb):
    """'model.py:137 Block.forward': where a traceback's error was raised, in this repository's code."""
    places = []
    while tb is not None:
        places.append((tb.tb_frame.f_code, tb.tb_lineno))
        tb = tb.tb_next
    return _at(places)


def _at(places):
    """'file.py:line Class.function' of the innermost of (code, line) `places` (outermost first) that is this
    repository's code, watchdog.py aside (else of the innermost)."""
    ours = [(c, n) for c, n in places if c.co_filename.startswith(HERE + os.sep) and c.co_filename != MINE]
    code, line = (ours or places)[-1]
    return f"{os.path.basename(code.co_filename)}:{line} {code.co_qualname}"


def waiting_in(frame):
    """What a thread waits in, from its innermost frame: 'all_reduce on lm tp [2, 3] at optim.py:210 AdamW.finish',
    or 'the wait at bridge.py:164 Bridge.backward_encoder' outside torch.distributed's calls (a request's wait,
    a device sync under NCCL, which blocks where the host next needs a result)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()                                   # outermost first
    line = _at([(f.f_code, f.f_lineno) for f in frames])
    call = next((f for f in frames if f.f_code.co_filename.endswith("distributed_c10d.py")), None)
    if call is None:
        return f"the wait at {line}"
    args = call.f_locals
    group, peer = args.get("group"), args.get("dst", args.get("src"))
    ops = args.get("p2p_op_list")
    if ops:                                            # batch_isend_irecv: its ops' group and peers
        group = ops[0].group
        peer = ", ".join(str(p) for p in sorted({op.peer for op in ops}))
    with_peer = f" with rank {peer}" if isinstance(peer, (int, str)) and peer != "" else ""
    label = "world" if group is None or group is dist.GroupMember.WORLD else \
        f"{_names.get(group, 'group')} {dist.get_process_group_ranks(group)}"
    return f"{call.f_code.co_name}{with_peer} on {label} at {line}"


def _ranks(rs):
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


class Watchdog:
    def __init__(self, timeout, beat=None):
        self.timeout = float(timeout)
        self.beat = beat or min(5.0, max(self.timeout / 10, 0.5))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # its own client: the main thread may be blocked inside the store itself (NCCL's set-up)
        self.store = dist.PrefixStore("watchdog/", dist.distributed_c10d._get_default_store().clone())
        self.store.set_timeout(datetime.timedelta(seconds=max(10 * self.beat, 30)))
        self.watched = threading.get_ident()
        self.ticks = math.ceil(self.beat / TICK_S)     # a beat every this many ticks
        self.seq, self.seen = 0, {}                    # seen: rank -> (its last sequence number, when it changed)
        self.signalled = 0                             # the first of SIGNALS this process got (0: none)
        self.wakeup, self.wakeup_w = socket.socketpair()   # the C handler writes each signal's number into it
        self.wakeup_w.setblocking(False)
        self.old_wakeup = signal.set_wakeup_fd(self.wakeup_w.fileno(), warn_on_full_buffer=False)
        self.done = threading.Event()
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def _run(self):
        ticks = 0
        try:
            while self._wait():
                self.ended()
                silent = self.signalled and self._silent()
                if silent:   # the main thread may never get to its signal
                    self._interrupted(silent)
                ticks += 1
                if ticks % self.ticks == 0:
                    self._check()
        except Exception:   # the store stopped answering: its host ended (the launcher, or rank 0 without it)
            self._alone()
        self.wakeup.close()

    def _wait(self):
        """A tick's wait for a signal -> whether the watched thread is still in main()."""
        if select.select([self.wakeup], [], [], self.beat / self.ticks)[0]:
            got = [s for s in self.wakeup.recv(64) if s in SIGNALS]
            self.signalled = self.signalled or (got[0] if got else 0)
        return not self.done.is_set()

    def ended(self):
        """Exits quietly when another rank ended the run: after a failure (FAILED_STATUS) or a verdict."""
        if self.store.check(["failed"]):
            self.store.add("gone", 1)   # a failed rank 0 may host the store: it waits for every rank's (fail)
            leave(FAILED_STATUS)
        if self.store.check(["verdict"]):
            leave(EXIT_STATUS)

    def _place(self):
        """(where, since when, how long it may stay there) of the watched thread."""
        where, since, first = _state
        return where, since, self.timeout * (FIRST if first else 1)

    def _waits(self):
        frame = sys._current_frames().get(self.watched)
        return waiting_in(frame) if frame is not None else "exited"

    def _check(self):
        where, since, limit = self._place()
        now, waits = time.monotonic(), self._waits()
        overdue = now - since > limit
        self.seq += 1
        self.store.set(str(self.rank), json.dumps([self.seq, overdue, where, waits]))
        if not overdue or self.done.is_set():
            return
        others = self._others(now)
        if any(alive and not r_overdue for alive, r_overdue, _, _ in others.values()):
            return                                     # another rank still makes progress: not stuck (yet)
        if self.store.add("verdict", 1) == 1:   # the first rank to see it reports; the others see the key and go
            print("error: " + self._message(where, waits, limit, others), file=sys.stderr, flush=True)
            self.done.wait(2 * self.beat)
        leave(EXIT_STATUS)

    def _others(self, now):
        """{rank: (alive, overdue, where, waits)} of the other ranks; alive: a new beat within the last three."""
        keys = [str(r) for r in range(self.world) if r != self.rank]
        if not self.store.check(keys):                 # one read for all once every rank has beaten
            keys = [k for k in keys if self.store.check([k])]
        beats = {int(k): json.loads(v) for k, v in zip(keys, self.store.multi_get(keys) if keys else [])}
        others = {}
        for r in set(range(self.world)) - {self.rank}:
            seq, overdue, where, waits = beats.get(r, (None, False, "set-up", "no beat yet"))
            if r not in self.seen or self.seen[r][0] != seq:
                self.seen[r] = (seq, now)
            others[r] = (now - self.seen[r][1] < 3 * self.beat, overdue, where, waits)
        return others

    def _silent(self):
        return sorted(r for r, (alive, *_) in self._others(time.monotonic()).items() if not alive)

    def _interrupted(self, silent):
        """A signal while `silent` ranks stopped beating (empty: the store is gone), whom the main thread may wait
        on for ever: the process ends now (the lowest rank still beating says why)."""
        name = signal.Signals(self.signalled).name
        if silent and self.rank == min(set(range(self.world)) - set(silent)):
            print(f"interrupted by {name} while {_ranks(silent)} {'does' if len(silent) == 1 else 'do'} not "
                  "answer: ended without saving", file=sys.stderr, flush=True)
        leave(128 + self.signalled)

    def _alone(self):
        """The store is gone (the run ends, or nobody can answer this rank any more): a signal ends it at once, and
        so does being overdue."""
        while self._wait():
            if self.signalled:
                self._interrupted([])
            where, since, limit = self._place()
            if time.monotonic() - since > limit:
                print(f"error: {self._waits()} did not complete in {limit:g} s on rank {self.rank} ({where}), and "
                      "the run's store stopped answering: the launcher or rank 0 ended. See their output",
                      file=sys.stderr, flush=True)
                leave(EXIT_STATUS)

    def _message(self, where, waits, limit, others):
        silent = sorted(set(range(self.world)) - {self.rank} - {r for r, o in others.items() if o[0]})
        head = f"{waits} did not complete in {limit:g} s on rank {self.rank} ({where})"
        if silent:
            verb = "is" if len(silent) == 1 else "are"
            return (f"{head} ({_ranks(silent)} {verb} not answering?). See {_ranks(silent)}'s output (a crash, out "
                    f"of memory, a stopped process, a lost node); if it is only slow, raise --collective-timeout "
                    f"(now {self.timeout:g} s)")
        places = {}
        for r, (_, _, r_where, r_waits) in others.items():
            places.setdefault(f"{r_waits} ({r_where})", []).append(r)
        elsewhere = "; ".join(f"{_ranks(rs)} in {p}" for p, rs in sorted(places.items(), key=lambda x: x[1]))
        return (f"{head} (every rank answers but waits: {elsewhere}). The ranks wait on each other: a deadlock "
                f"(docs/parallel.md §9); report this line with the command. If a rank is only slow, raise "
                f"--collective-timeout (now {self.timeout:g} s)")
