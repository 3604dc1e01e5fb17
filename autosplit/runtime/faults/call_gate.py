"""Every user-facing call that communicates first checks that every rank made the same call.

Terms:
  call    -- one of ParallelModule's communicating entry points (step, predict, clip_grad_norm_,
             full_state_dict, load_full_state_dict), named by its method name.
  counter -- how many such calls this ParallelModule has made, 1 for the first; equal on every rank
             as long as the ranks make the same calls.
  row     -- what a rank contributes: (nonce, hash of the call's name, counter, hash of its
             arguments' shapes and values that must agree, 1 if this rank's own argument checks
             failed).  ONE all_gather of these 5 int64 per call (exchange.gather_rows).

Why before anything else in the call: a collective that only some ranks enter (``clip_grad_norm_``
on one rank, a ``step`` whose batch fails a check on one rank only) would otherwise pair with an
unrelated collective of the other ranks and hang or abort gloo; after the gate either every rank
goes on, or every rank raises the same AutosplitError and the module stays usable (no rank has
started the call's communication).
"""
from __future__ import annotations

import json

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.exchange import by_value, gather_rows, nonce, share_texts, stable_hash, who


class CallGate:
    def __init__(self, world, watchdog):
        self.world, self.watchdog, self.calls = world, watchdog, 0

    def enter(self, call: str, args: str, key: str, error: str | None) -> None:
        """Exchange this rank's (call, counter, arguments, error) with every rank; raise on any difference.

        Args:
          call: the method's name.
          args: the arguments as readable text, shown when ranks differ.
          key: what must be equal on every rank (its hash is exchanged).
          error: this rank's argument problem, or None.
        """
        self.calls += 1
        n = self.calls
        row = [nonce(), stable_hash(call), n, stable_hash(key), int(error is not None)]
        rows = gather_rows(self.world, self.watchdog, row, f"call check of {call} (call {n})")
        if all(r[1:] == rows[0][1:] for r in rows):
            if error is not None:      # the same call failed the same checks on every rank
                raise AutosplitError(error)
            return
        shared = [json.loads(s) for s in share_texts(self.world, self.watchdog, rows[0][0], json.dumps(
            {"call": call, "n": n, "args": args, "error": error}), f"call check of {call} (call {n}), sharing why")]
        raise AutosplitError(self._message(shared, rows))

    def _message(self, shared: list[dict], rows: list[list[int]]) -> str:
        # the causes first (a rank's own argument problem), then how the calls differ
        parts = [f"{who(ranks, self.world)} found: {err}" for ranks, err in by_value([s["error"] or "" for s in shared])
                 if err]
        if parts:
            parts.append(f"so no rank ran {shared[self.world.rank]['call']} (call {shared[self.world.rank]['n']})")
        if any(r[1:4] != rows[0][1:4] for r in rows):
            same_call = len({(s["call"], s["n"]) for s in shared}) == 1
            said = [f"{who(ranks)} called {value}" for ranks, value in by_value(
                [f"{s['call']} (call {s['n']})" + (f" with {s['args']}" if same_call else "") for s in shared])]
            parts.append(" while ".join(said) + "; every rank must make the same autosplit calls (step, predict, "
                         "clip_grad_norm_, full_state_dict, load_full_state_dict), in the same order, with the "
                         "same shapes and values")
        return "; ".join(parts)
