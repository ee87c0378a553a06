"""The micro-batches of one step, or of one evaluation, in the order every rank runs them (docs/parallel.md §7, §9).

Training is 1F1B over the bridge. For micro-batch k of n:
  vision ranks    encode k, send its rows; then the backward of k - 1 (steady state: two in flight)
  language ranks  receive the rows of k, forward, backward, send their gradient back
  vision ranks    after the last: the backward of what is in flight (cool-down)
So the encoder's forward of k + 1 overlaps the language side's work on k. Colocated (both modules on every rank),
the same lines run one after the other and the bridge hands the rows over in place: the language backward reaches
the encoder itself. An evaluation runs forward only, micro-batch by micro-batch, nothing travelling back.

The no-deadlock rule (docs/parallel.md §9): a rank may block its host only in an operation that every rank it waits
for reaches next without first waiting on it. NCCL blocks the host where gloo does not (a communicator's set-up, a
pair's first transfer, a device sync), so only runs over NCCL show a violation; tests/test_gpu.py runs them. Here:
- The signal check (failsafe.Stop: a gloo all-reduce every rank joins) sits where neither side waits for a bridge
  message the other posts only after the check. Training: a vision-only rank checks after its micro-batch k (rows
  of k sent, backward of k - 1 done), a language rank before its micro-batch k (gradient of k - 1 sent). An
  evaluation: every rank before micro-batch k; a language rank has then received the rows of the micro-batches
  before k, which the vision side posted before its check k, and nothing travels back.
- A step stopped there is abandoned so that nothing stays in flight: the language side receives the rows of k
  (sent before the vision side's check) and returns a zero gradient; the vision side runs the backward of what it
  holds. failsafe.abandon_step then undoes the rest of the step.
- The bridge orders its own transfers (bridge.py: links opened in set-up, the gradient receive of k posted before
  the send of k + 1).
Pipeline stages join here: a stage is one more pair of sends and receives per micro-batch, under the same rule.
"""
import torch


class Schedule:
    """The order of one rank's micro-batch work around its bridge (bridge.Bridge). Per call:
    encode(k) -> (rows [R, D], rows per sample) of micro-batch k (ranks holding the tower; None elsewhere);
    language(k, rows, rows per sample) -> (vlm.LossParts, the tensor to backward, or None in an evaluation) (ranks
    holding the language model; None elsewhere); stop: failsafe.Stop; mark(k): where the watchdog says the rank is."""

    def __init__(self, bridge):
        self.bridge = bridge

    def train(self, n_micro, encode, language, stop, mark):
        """One step's micro-batches with their backward -> [LossParts] of this rank's language lane ([] without
        one), or None when a signal stopped the step (every rank agreeing; nothing left in flight)."""
        bridge, out = self.bridge, []
        for k in range(n_micro):
            mark(k)
            if language and stop():
                break
            if encode:
                bridge.send(*encode(k))
                if bridge.in_flight == 2:   # 1F1B: the previous micro-batch's backward after this forward
                    bridge.backward_encoder()
            if language:
                parts, objective = language(k, *bridge.recv())
                objective.backward()
                bridge.send_grad()
                out.append(parts)
            if not language and stop():
                break
        if stop.agreed and language and not encode and not bridge.lay.colocated:
            with torch.no_grad():   # the rows the vision side sent before its check
                bridge.recv()
                bridge.send_grad()
        while bridge.in_flight:   # cool-down (after a stop: what the vision side holds)
            bridge.backward_encoder()
        return None if stop.agreed else out

    def evaluate(self, n_micro, encode, language, stop, mark):
        """Micro-batches forward only -> [LossParts] of this rank's language lane, or None when a signal stopped
        the evaluation (nothing in flight: every micro-batch ends with bridge.release())."""
        out = []
        for k in range(n_micro):
            mark(k)
            if stop():
                return None
            if encode:
                self.bridge.send(*encode(k))
            if language:
                out.append(language(k, *self.bridge.recv())[0])
            self.bridge.release()
        return out
