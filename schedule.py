"""The micro-batches of one step, or of one evaluation, in the order every rank runs them (docs/parallel.md §7, §9;
docs/pipeline.md).

Training is 1F1B over the bridge and the language model's pipeline stages. With p stages (lm_pp; 1 without a
pipeline), stage s of p runs p - 1 - s forwards ahead of its first backward, and the encoder p ahead of its (the
warm-up). In round k of the n micro-batches (the steady state, once both are due):
  vision ranks     encode k, send its rows; the backward of k - p
  stage s          receive k (stage 0: the rows, over the bridge; else the previous stage's output, in one batch
                   with the gradient of its last backward going back); forward k; send its output on (in one batch
                   with the receive of the gradient of k - (p - 1 - s)); that micro-batch's backward; stage 0 sends
                   the gradient of its rows back over the bridge
then rounds n .. n + p - 1 drain the backwards still due (the cool-down). So the encoder's forward of k + 1
overlaps the language side's work on k, and every stage works on a micro-batch of its own. Colocated (both modules
on every rank), the same lines run one after the other; in place (p = 1, the same lanes) the bridge hands the rows
over in memory and the language backward reaches the encoder itself. An evaluation runs forward only, micro-batch
by micro-batch, nothing travelling back.

The no-deadlock rule (docs/parallel.md §9): a rank may block its host only in an operation that every rank it waits
for reaches next without first waiting on it. NCCL blocks the host where gloo does not (a communicator's set-up, a
pair's first transfer, a device sync), so only runs over NCCL show a violation; tests/test_gpu.py runs them. Here:
- The signal check (failsafe.Stop: a gloo all-reduce every rank joins) sits where neither side waits for a message
  the other posts only after the check. Training: a vision-only rank checks after its round k (rows of k sent,
  backward of k - p done: its gradient left stage 0 in round k - 1), a language rank before its round k. Every
  transfer of a round between two stages is matched in that round. An evaluation: every rank before micro-batch k.
- A step stopped there is abandoned so that nothing stays in flight: stage 0 receives the rows of k where the vision
  side sent them before its check, and returns a zero gradient for every micro-batch it holds, one before each of the
  encoder's backwards that waits for it; the stages drop their graphs (their pending transfers were to be posted in
  round k, by both sides). failsafe.abandon_step then undoes the rest of the step.
- The bridge and the pipe order their own transfers (bridge.py, pipeline.py: links opened in set-up; between stages
  one batch per pair and round; over the bridge the gradient receive of m posted before the rows of m + p).
"""
import torch


class Schedule:
    """The order of one rank's micro-batch work around its bridge (bridge.Bridge) and its pipe (pipeline.Pipe; None
    off the language grid). Per call:
    encode(k) -> (rows [R, D], rows per sample) of micro-batch k (ranks holding the tower; None elsewhere);
    language(k, rows, rows per sample, received) -> (vlm.LossParts, the tensor to backward, or None in an
    evaluation) on the last stage, (None, [outputs to send on]) on the others; `received`: the previous stage's
    outputs (None on the first stage, which gets the rows) (ranks holding the language model; None elsewhere);
    stop: failsafe.Stop; mark(k): where the watchdog says the rank is."""

    def __init__(self, bridge, pipe=None):
        self.bridge, self.pipe = bridge, pipe

    def train(self, n_micro, encode, language, stop, mark, mtp=False):
        """One step's micro-batches with their backward -> [LossParts] of this rank's language lane on the last
        stage ([] elsewhere), or None when a signal stopped the step (every rank agreeing; nothing left in flight).
        mtp: the decoder input travels beside the residual stream (the last stage's MTP blocks read it). A stage
        trades alike in every round (one batch per pair); its phase says whether its forward and backward run."""
        bridge, pipe, p = self.bridge, self.pipe, self.bridge.depth
        out, held, up = [], [], None   # held: (inputs, outputs) awaiting backward; up: their input grads, sent next

        def stage(k):
            nonlocal up
            ahead = p - 1 - pipe.stage                 # forwards before the first backward (the warm-up)
            forward, backward = k < n_micro, ahead <= k < n_micro + ahead   # the backward of k - ahead
            received = None if pipe.first else pipe.trade_up(up, forward, mtp)
            if forward:
                parts, result = language(k, *(bridge.recv() if pipe.first else (None, None)), received)
                if pipe.last:
                    out.append(parts)
                held.append((received, [result] if pipe.last else result))
            grads = None if pipe.last else pipe.trade_down(result if forward else None, backward, mtp)
            up = None
            if backward:
                inputs, outputs = held.pop(0)
                torch.autograd.backward(outputs, grads)
                if pipe.first:
                    bridge.send_grad()
                else:
                    up = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]

        def run(k):                                    # round k of each module this rank holds
            if encode and k < n_micro:
                bridge.send(*encode(k))
            if encode and k >= p:
                bridge.backward_encoder()              # of k - p
            if language:
                stage(k)

        for k in range(n_micro):                       # the warm-up and the steady state
            mark(k)
            if language and stop():                    # a language rank checks before its round
                break
            run(k)
            if encode and not language and stop():     # a vision-only rank after it
                break
        else:
            for k in range(n_micro, n_micro + p):      # the cool-down
                run(k)
        if stop.agreed:
            if language and not encode and pipe.first:
                with torch.no_grad():   # the rows the vision side sent before its check
                    bridge.recv()
            while bridge.in_flight or bridge.held:   # each gradient sent before the encoder backward waiting for it
                if bridge.held and bridge.held >= bridge.in_flight:
                    bridge.send_grad()
                else:
                    bridge.backward_encoder()
        bridge.release()
        return None if stop.agreed else out

    def evaluate(self, n_micro, encode, language, stop, mark):
        """Micro-batches forward only -> [LossParts] of this rank's language lane on the last stage, or None when a
        signal stopped the evaluation (nothing in flight: every micro-batch ends with bridge.release())."""
        bridge, pipe, out = self.bridge, self.pipe, []
        for k in range(n_micro):
            mark(k)
            if stop():
                return None
            if encode:
                bridge.send(*encode(k))
            if language:
                received = None if pipe.first else pipe.trade_up(None, True, False)
                parts, result = language(k, *(bridge.recv() if pipe.first else (None, None)), received)
                if pipe.last:
                    out.append(parts)
                else:
                    pipe.trade_down(result, False, False)
            bridge.release()
        return out
