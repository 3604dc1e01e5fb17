"""Strategy search: every (pp, tp, dp) mesh and option set of a model on W devices, ranked by the cost model.

A package named ``strategy`` rather than ``search``: ``autosplit.search`` is the public function, and a
submodule of that name would replace it on the package once imported (autosplit/__init__.py).
"""
from autosplit.strategy.candidate import Candidate, Rejected, SearchResult
from autosplit.strategy.search import search

__all__ = ["Candidate", "Rejected", "SearchResult", "search"]
