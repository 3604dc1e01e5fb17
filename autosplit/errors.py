"""Error types autosplit raises.

Every error names the thing at fault (node, layer, argument) and, where a number is involved,
shows the arithmetic, so the user can fix the call without reading our source.
"""


class AutosplitError(ValueError):
    """Bad input to autosplit: a mesh, a model or an argument we cannot plan for."""


class TraceError(AutosplitError):
    """The model could not be traced by torch.fx; the message names the module and line."""


class PlanError(AutosplitError):
    """A valid model for which the requested plan cannot be built (e.g. too many stages)."""


class RankError(AutosplitError, IndexError):
    """A pipeline / tensor-parallel rank outside the mesh (an IndexError too, for callers that catch one)."""
