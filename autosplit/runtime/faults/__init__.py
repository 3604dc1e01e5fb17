"""Faults: no rank waits forever, and a failure ends every rank with a message naming it.

  deadlines.py      waiting with a deadline; ending every rank when one fails
  deferred.py       NCCL works the watchdog has not checked yet, and when it must
  heartbeat.py      per-rank liveness in the job's store
  serial_thread.py  a daemon thread running functions one at a time, in order
  exchange.py       small exchanges between all ranks (for agreement and the call gate)
  arguments.py      before any group is built: every rank passed parallelize the same mesh (through the store)
  job_store.py      when autosplit starts the process group: every rank joins the store within timeout_s
  agreement.py      before the first step: every rank planned the same job and holds the same model
  call_gate.py      every user-facing call that communicates: every rank made the same call
  call_checks.py    ParallelModule's entry points' argument checks, on every rank
  loss_check.py     the loss function's contract, per microbatch

May import: ``autosplit.errors``; of the runtime, this room only.
"""
