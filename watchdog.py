"""Nothing hangs (docs/parallel.md §9): a run whose ranks stop making progress ends within --collective-timeout,
with one line from one rank naming the operation it waits in, its group and the rank that does not answer.

The main thread marks where it is (mark: a new place, e.g. a micro-batch; progress: still busy in the same place,
e.g. one more file written). A daemon thread per rank beats into the run's store: a sequence number, whether the
main thread is overdue (in one place longer than the timeout, or FIRST times it in set-up, a first step or a first
evaluation) and where it waits, read off its stack. An overdue rank looks at the others' beats; once every other
rank is overdue too or has stopped beating (a stopped, crashed or swapping process), the run is stuck: the first
rank to claim the verdict prints the line, and every rank that sees it exits with EXIT_STATUS (torchrun then ends
the rest). torch's own process-group timeouts (the timeout plus BACKSTOP_S) end the run only if this thread cannot.
"""
import datetime
import json
import os
import sys
import threading
import time

import torch.distributed as dist

EXIT_STATUS = 3          # a stuck run (2: a user error, 128 + N: a signal)
FIRST = 4                # set-up, the first step and the first evaluation of a process: this many timeouts
BACKSTOP_S = 3600.0      # torch's own process-group timeouts: the timeout plus this
HERE = os.path.dirname(os.path.abspath(__file__))

_names = {}              # process group -> its label in messages (parallel.setup, failsafe.Stop)
_active = None           # this process's Watchdog while main() runs, else None


def name(group, label):
    _names[group] = label


def backstop(timeout):
    """The timeout to give torch's process groups."""
    return datetime.timedelta(seconds=timeout + BACKSTOP_S)


def start(timeout, beat=None):
    """Watch this process (the calling thread is the one watched); nothing to watch on one rank."""
    global _active
    stop()
    if dist.get_world_size() > 1:
        _active = Watchdog(timeout, beat)


def stop():
    """The watched thread leaves main(): normally, or by an error another rank's exit caused after a verdict (then
    it exits as the watchdog would, without a traceback)."""
    global _active
    if _active is not None:
        _active.done.set()
        if _active.stuck():
            _exit()
        _active = None


def _exit():
    devnull = os.open(os.devnull, os.O_WRONLY)   # what the dying run raises in this rank's main thread meanwhile
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os._exit(EXIT_STATUS)


def mark(where, first=False):
    """The watched thread is at a new place; it may stay there the timeout (FIRST times it in a first step)."""
    if _active is not None:
        _active.state = (where, time.monotonic(), _active.timeout * (FIRST if first else 1))


def progress():
    """Still busy at the same place (a long loop of its own: files written, tensors read)."""
    if _active is not None:
        where, _, limit = _active.state
        _active.state = (where, time.monotonic(), limit)


def waiting_in(frame):
    """What a thread waits in, from its innermost frame: 'all_reduce on lm tp [2, 3] at optim.py:210 AdamW.finish',
    or 'the wait at bridge.py:164 Bridge.backward_encoder' outside torch.distributed's calls (a request's wait,
    a device sync under NCCL, which blocks where the host next needs a result)."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()                                   # outermost first
    ours = [f for f in frames if f.f_code.co_filename.startswith(HERE + os.sep)
            and f.f_code.co_filename != os.path.join(HERE, "watchdog.py")]
    at = ours[-1] if ours else frames[-1]
    line = f"{os.path.basename(at.f_code.co_filename)}:{at.f_lineno} {at.f_code.co_qualname}"
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
        self.state = ("set-up", time.monotonic(), self.timeout * FIRST)
        self.seq, self.seen = 0, {}                    # seen: rank -> (its last sequence number, when it changed)
        self.done = threading.Event()
        threading.Thread(target=self._run, name="watchdog", daemon=True).start()

    def _run(self):
        try:
            while not self.done.wait(self.beat):
                if self.stuck():
                    _exit()
                self._check()
        except Exception:   # the store is gone: the launcher is ending the run
            return

    def stuck(self):
        """Whether some rank declared the run stuck."""
        try:
            return self.store.check(["verdict"])
        except Exception:
            return False

    def _check(self):
        where, since, limit = self.state
        frame = sys._current_frames().get(self.watched)
        now = time.monotonic()
        overdue = now - since > limit
        waits = waiting_in(frame) if frame is not None else "exited"
        self.seq += 1
        self.store.set(str(self.rank), json.dumps([self.seq, overdue, where, waits]))
        if not overdue or self.done.is_set():
            return
        others = {}
        keys = [str(r) for r in range(self.world) if r != self.rank]
        if not self.store.check(keys):                 # one read for all once every rank has beaten
            keys = [k for k in keys if self.store.check([k])]
        for k, value in zip(keys, self.store.multi_get(keys) if keys else []):
            r, (seq, r_overdue, r_where, r_waits) = int(k), json.loads(value)
            if self.seen.get(r, (None,))[0] != seq:
                self.seen[r] = (seq, now)
            alive = now - self.seen[r][1] < 3 * self.beat
            others[r] = (alive, r_overdue, r_where, r_waits)
        if len(others) < self.world - 1 and now - since < limit + 3 * self.beat:
            return                                     # a rank that never beat: give it the same three beats
        if any(alive and not r_overdue for alive, r_overdue, _, _ in others.values()):
            return                                     # another rank still makes progress: not stuck (yet)
        if self.store.add("verdict", 1) == 1:   # the first rank to see it reports; the others see the key and go
            print("error: " + self._message(where, waits, limit, others), file=sys.stderr, flush=True)
            self.done.wait(2 * self.beat)
        _exit()

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
