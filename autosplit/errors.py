"""Error types autosplit raises.

Every error names the thing at fault (node, layer, argument) and, where a number is involved,
shows the arithmetic, so the user can fix the call without reading our source.  An exception of any
other type escaping planning is an autosplit bug: ``rule_failure`` / ``at_node`` turn it into a PlanError
that names the graph node and module path and says so.
"""
from contextlib import contextmanager


class AutosplitError(ValueError):
    """Bad input to autosplit: a mesh, a model or an argument we cannot plan for."""


class TraceError(AutosplitError):
    """The model could not be traced by torch.fx; the message names the module and line."""


class PlanError(AutosplitError):
    """A valid model for which the requested plan cannot be built (e.g. too many stages)."""


class RankError(AutosplitError, IndexError):
    """A pipeline / tensor-parallel rank outside the mesh (an IndexError too, for callers that catch one)."""


REPORT = "this is an autosplit bug, not a problem with your model or arguments; please report it with the message"


def rule_failure(what: str, node, exc: BaseException) -> PlanError:
    """A PlanError for an exception our own code raised while handling graph node ``node`` (a
    torch.fx.Node): names the node, what it runs, the module it came from, and the original error.
    Raise it ``from exc`` so the traceback keeps the cause."""
    target = getattr(getattr(node, "target", None), "__name__", getattr(node, "target", None))
    path = getattr(node, "meta", {}).get("module_path", "") or "<root>"
    return PlanError(f"{what} failed at node '{getattr(node, 'name', node)}' ({getattr(node, 'op', '?')} {target}) "
                     f"in module '{path}': {type(exc).__name__}: {exc}; {REPORT}")


@contextmanager
def at_node(what: str, node):
    """Run a rule for graph node ``node``: an AutosplitError passes as it is; any other exception is our
    bug and leaves as ``rule_failure(what, node, exc)``."""
    try:
        yield
    except AutosplitError:
        raise
    except Exception as exc:                # noqa: BLE001  (every other error is ours: name the node)
        raise rule_failure(what, node, exc) from exc
