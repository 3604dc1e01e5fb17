"""Old spellings kept for one release: each warns, naming the new spelling, and then means exactly it.

Terms:
  alias    -- an old name of a keyword argument, a dict key or a command-line flag (issue 48: one name
              per idea across the API and the CLI).  It keeps working for one release.
  warning  -- API keywords and dict keys: a ``DeprecationWarning`` at the caller's line (``stacklevel``);
              command-line flags: one ``autosplit: warning: ...`` line on stderr, which a person at a
              terminal sees (a DeprecationWarning raised outside ``__main__`` is hidden by default).

Every alias in the package goes through this module, so ``grep autosplit.deprecated`` lists them all.
"""
from __future__ import annotations

import argparse
import sys
import warnings

from autosplit.errors import AutosplitError

RENAMED_OPTIONS = {"checkpoint": "recompute"}     # PlanOptions / compile / parallelize keywords, old -> new


def message(old: str, new: str) -> str:
    """The one sentence every alias says."""
    return f"{old} is deprecated and will be removed in the next release; use {new}"


def warn_renamed(old: str, new: str, stacklevel: int = 2) -> None:
    """A DeprecationWarning for the API spelling ``old``, pointing ``stacklevel`` frames up from here (1: the
    caller of this function)."""
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=stacklevel + 1)


def warn_flag(old: str, new: str) -> None:
    """The stderr line for a deprecated command-line flag (see *warning*)."""
    print(f"autosplit: warning: {message(old, new)}", file=sys.stderr)


def renamed_keywords(caller: str, kwargs: dict, renamed: dict, stacklevel: int = 2) -> dict:
    """``kwargs`` with each old keyword of ``renamed`` (old -> new) moved to its new name, warning once
    per old name.  Both spellings at once is an error naming the two: which one would be meant is a guess.

    Args:
        caller: the function named in the error, e.g. "compile".
        kwargs: the keywords as given (not changed).
        stacklevel: where the warning points, counted up from this function: 1 its caller, 2 the
            caller's caller (as ``warnings.warn``'s, one frame higher).
    """
    out = dict(kwargs)
    for old, new in renamed.items():
        if old not in out:
            continue
        if new in out:
            raise AutosplitError(f"{caller}() got both {new}= and its deprecated spelling {old}=; pass {new}= only")
        warn_renamed(f"{caller}({old}=...)", f"{new}=", stacklevel + 1)
        out[new] = out.pop(old)
    return out


def positional_keywords(caller: str, names: tuple, args: tuple, given: dict, defaults: dict,
                        stacklevel: int = 2) -> dict:
    """The arguments an old positional call passed after the positional ones that stay (``args``), by name:
    ``names`` are the keywords they were, in their old order.  Warns naming them; a name also given by
    keyword (a value other than its default in ``given``) is an error, as Python's own "multiple values".

    Args:
        caller: the function named in the warning and the error, e.g. "compile".
        names: the old positional parameters after the ones that stay, in order.
        args: the extra positional values received.
        given: every keyword parameter's value as received; defaults: their defaults.
        stacklevel: as ``renamed_keywords``'s (2: the caller's caller).
    """
    if not args:
        return {}
    if len(args) > len(names):
        raise AutosplitError(f"{caller}() takes at most {len(names)} positional arguments after the ones the API "
                             f"names ({', '.join(names)}, all deprecated positionally); got {len(args)}")
    out = dict(zip(names, args))
    def default(n):     # identity first: a tensor (example_input) is never compared with ==
        return given[n] is defaults[n] or (type(given[n]) is type(defaults[n]) and given[n] == defaults[n])
    twice = [n for n in out if not default(n)]
    if twice:
        raise AutosplitError(f"{caller}() got multiple values for {', '.join(twice)} (positionally and by keyword)")
    warn_renamed(f"passing {', '.join(out)} to {caller}() positionally",
                 f"keywords ({', '.join(f'{n}=...' for n in out)})", stacklevel + 1)
    return out


class RenamedKeys(dict):
    """A dict whose old keys (``renamed``: old -> new) still read, with a DeprecationWarning: the search's
    candidate ``.options``.  Iteration, ``**`` unpacking and equality see the new keys only."""

    def __init__(self, data, renamed: dict):
        super().__init__(data)
        self.renamed = renamed

    def _key(self, key):
        if key in self.renamed and not dict.__contains__(self, key):
            warn_renamed(f"options[{key!r}]", f"options[{self.renamed[key]!r}]", stacklevel=3)
            return self.renamed[key]
        return key

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def get(self, key, default=None):
        return super().get(self._key(key), default)

    def __contains__(self, key):
        return super().__contains__(self._key(key))

    def __reduce__(self):       # pickles (a candidate sent between ranks) as this class with its aliases
        return (RenamedKeys, (dict(self), self.renamed))


class DeprecatedFlag(argparse.Action):
    """An argparse action for a flag with deprecated option strings: ``deprecated`` maps each old option
    string to the new one; using an old one stores the value as the new one does, after ``warn_flag``.
    Any ``store`` / ``store_true`` behaviour is chosen with ``nargs`` / ``const`` as argparse's own."""

    def __init__(self, option_strings, dest, deprecated: dict, **kwargs):
        self.deprecated = deprecated
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in self.deprecated:
            warn_flag(option_string, self.deprecated[option_string])
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def deprecated_entry_point(old: str, new: str) -> None:
    """A module entry point kept for one release (``python -m OLD``): the stderr line naming ``new``."""
    warn_flag(old, new)
