"""The unit of a pipeline schedule: one action of one stage on one microbatch.

Terms:
  stage      -- a global pipeline stage ``s``; stage ``s`` sends activations to ``s+1`` and gradients
                to ``s-1``.  Which rank holds it is the schedule's placement (placement.py).
  microbatch -- index ``i`` of a microbatch within one optimizer step, ``0 <= i < m``.
  F, B       -- compute: forward / backward of one stage on one microbatch (one time step each).
  I, W       -- the backward split in two (zero-bubble schedules): I computes the gradient of the
                stage's input (and the cheap parameter gradients: biases, norms) and hands it on;
                W computes the weight gradients I queued for that (stage, microbatch).  A schedule
                uses either B or I and W for every (stage, microbatch); W comes after its I.
  SEND_F     -- stage ``s`` sends its output activation of microbatch ``i`` to stage ``s+1``.
  RECV_F     -- stage ``s`` receives its input activation of microbatch ``i`` from stage ``s-1``.
  SEND_B     -- stage ``s`` sends the gradient of its input for microbatch ``i`` to stage ``s-1``.
  RECV_B     -- stage ``s`` receives the gradient of its output for microbatch ``i`` from stage ``s+1``.

For a communication action, ``stage`` is always the *local* stage (the one sending or receiving);
``peer_stage`` is the stage at the other end.

  Group      -- communication actions one rank posts together, as one NCCL group (``batch_isend_irecv``):
                they are in flight at the same time, and the group is done when every one of them has
                met its peer.  Lowered lists hold computes and groups (see lower.py).

The compact text form is ``f"{stage}{kind}{microbatch}"``: ``2F0``, ``1B3``, ``1I3``, ``0W2``, ``3SEND_F1``; a group is
its actions in brackets, ``[0SEND_F1 0RECV_B0]``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Union


class ActionKind(Enum):
    F = "F"
    B = "B"
    I = "I"
    W = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    # Members are singletons compared by identity (Enum defines no __eq__), so identity's C-level hash is
    # consistent with equality; Enum's own hashes the name in Python, and the timed run's structures hash
    # ~10^6 actions.  (Neither is stable across processes: a str hash is salted too.)
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)

    @property
    def sends_grad(self) -> bool:
        """Does this compute produce the gradient of the stage's input (B, or I)?"""
        return self in (ActionKind.B, ActionKind.I)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_F, ActionKind.SEND_B)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_F, ActionKind.RECV_B)


F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W
SEND_F, RECV_F = ActionKind.SEND_F, ActionKind.RECV_F
SEND_B, RECV_B = ActionKind.SEND_B, ActionKind.RECV_B

# The receive that consumes each send, and vice versa (the peer runs the matching action).
MATCHING = {SEND_F: RECV_F, RECV_F: SEND_F, SEND_B: RECV_B, RECV_B: SEND_B}

_PATTERN = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(\d+)$")


@dataclass(frozen=True)
class Action:
    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.name}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def is_compute(self) -> bool:
        return self.kind.is_compute

    @property
    def peer_stage(self) -> int:
        """The stage at the other end of a communication action."""
        if self.kind in (SEND_F, RECV_B):
            return self.stage + 1
        if self.kind in (RECV_F, SEND_B):
            return self.stage - 1
        raise ValueError(f"{self} is a compute action; only SEND_*/RECV_* actions have a peer stage")

    def matching(self) -> "Action":
        """The action the peer stage runs to complete this communication (RECV_F <-> SEND_F...)."""
        return Action(self.peer_stage, MATCHING[self.kind], self.microbatch)

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of ``str``: ``Action.parse("3SEND_F1") == Action(3, SEND_F, 1)``."""
        found = _PATTERN.match(text.strip())
        if found is None:
            raise ValueError(
                f"cannot parse action {text!r}; expected <stage><kind><microbatch> with kind one of "
                f"{', '.join(k.name for k in ActionKind)}, e.g. '2F0', '1I3' or '3SEND_F1'"
            )
        stage, kind, microbatch = found.groups()
        return cls(int(stage), ActionKind[kind], int(microbatch))


@dataclass(frozen=True)
class Group:
    """Communication actions posted together (one ``batch_isend_irecv``); never empty."""
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + " ".join(map(str, self.actions)) + "]"

    def __repr__(self) -> str:
        return f"Group({self})"

    is_compute = False

    @classmethod
    def parse(cls, text: str) -> "Group":
        """Inverse of ``str``: ``Group.parse("[0SEND_F1 0RECV_B0]")``."""
        inner = text.strip()
        if not (inner.startswith("[") and inner.endswith("]")) or not inner[1:-1].split():
            raise ValueError(f"cannot parse group {text!r}; expected '[<action> <action> ...]', "
                             f"e.g. '[0SEND_F1 0RECV_B0]'")
        actions = tuple(Action.parse(a) for a in inner[1:-1].split())
        for a in actions:
            if a.is_compute:
                raise ValueError(f"group {text!r} holds the compute action {a}; groups hold SEND_*/RECV_* only")
        return cls(actions)


Item = Union[Action, Group]   # one entry of a lowered list: a compute action or a communication group


def parse_item(text: str) -> Item:
    """``Action.parse`` or ``Group.parse``, by the text's first character."""
    return Group.parse(text) if text.strip().startswith("[") else Action.parse(text)
