"""Reading a checkpoint without running code from it: every pickle in it is loaded against an allow-list.

Terms:
  pickle       -- DCP keeps two kinds in a checkpoint: ``.metadata`` (``pickle.dump`` of DCP's
                  ``Metadata``: every entry's shape, dtype and chunks, and where its bytes lie), and the
                  byte entries (``torch.save`` of each Python value in the state dict: the optimizer's
                  hyperparameters and parameter names, an extra's ints and lists).  The tensors' own data
                  DCP already reads with ``torch.load(weights_only=True)``.
  global       -- a ``module.name`` a pickle asks for (its GLOBAL / STACK_GLOBAL opcodes); unpickling
                  calls it or builds it.  An untrusted checkpoint could ask for ``posix.system``: plain
                  ``pickle.load`` (DCP's ``FileSystemReader.read_metadata``) and ``torch.load(...,
                  weights_only=False)`` (DCP's ``DefaultLoadPlanner.load_bytes``) would run it.
  allow-list   -- the globals a checkpoint may name: METADATA_GLOBALS (DCP's metadata classes, torch's
                  dtypes, layouts and sizes, paths, plain containers) for ``.metadata``; for byte entries
                  torch's own ``weights_only`` list (tensors and their storages' rebuild functions,
                  dtypes, ``torch.Size``, plain containers, numbers, strings, bytes, None) plus
                  BYTE_ENTRY_GLOBALS.  Anything else is refused with an AutosplitError that names the file
                  and the global.
  safe reader  -- ``SafeReader`` (a ``FileSystemReader`` whose ``read_metadata`` uses the allow-list) with
                  ``SafePlanner`` (a ``DefaultLoadPlanner`` whose ``load_bytes`` uses ``weights_only=True``);
                  ``load(state, reader, ...)`` runs ``dcp.load`` with both and turns a refusal on any rank
                  into the same AutosplitError on every rank.
Everything that reads a checkpoint (``load_checkpoint``, ``export``) goes through here.  No process group
of its own: ``load`` uses the one it is given.
"""
from __future__ import annotations

import io
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from autosplit.errors import AutosplitError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DTYPES = tuple(sorted(n for n, v in vars(torch).items() if isinstance(v, torch.dtype)))
_LAYOUTS = tuple(sorted(n for n, v in vars(torch).items() if isinstance(v, (torch.layout, torch.memory_format))))

# module -> the names a `.metadata` pickle may ask for.  Found by listing the globals of the `.metadata` files
# the tests write (a pickle.Unpickler recording find_class): DCP's metadata and planner classes, dtypes,
# torch.Size, torch.serialization._get_layout (TensorProperties keeps its layout by name), the
# checkpoint_id's path; plus the other dtypes/layouts/paths and the plain containers that need a global.
METADATA_GLOBALS: dict[str, tuple[str, ...]] = {
    _DCP_METADATA: ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorStorageMetadata",
                    "BytesStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),     # where each entry's bytes lie
    "torch": ("Size", "device", *_DTYPES, *_LAYOUTS),
    "torch.serialization": ("_get_layout",),          # looks a layout up by its name; on torch's own list too
    "pathlib": ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"),
    "pathlib._local": ("Path", "PosixPath", "WindowsPath"),         # Python >= 3.13's module for them
    "builtins": ("set", "frozenset", "bytearray", "complex"),
    "collections": ("OrderedDict",),
}

# Additions to torch's weights_only list for byte entries (torch.serialization.safe_globals): none needed --
# what autosplit and the tests save there (optimizer hyperparameters, name lists, an extra's numbers) is
# plain data.  A job whose extras keep other types adds them here, not by loading with weights_only=False.
BYTE_ENTRY_GLOBALS: tuple = ()

_REFUSED = "(not on autosplit's allow-list of checkpoint types)"


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only METADATA_GLOBALS.

    Why our own Unpickler: ``.metadata`` is a plain ``pickle.dump`` (not a ``torch.save`` zip), which
    ``torch.load(weights_only=True)`` does not read, and DCP's reader has no safe mode; ``find_class`` is
    where pickle resolves every global (GLOBAL, STACK_GLOBAL and the copyreg extension codes), so refusing
    there refuses before anything is called.  Exact (module, name) pairs: no dotted names that would walk
    attributes (``Metadata.__init__.__globals__``), and ``fix_imports=False``: no Python 2 name is mapped to
    another after the check.  No ``persistent_load``: a persistent id is refused by pickle itself."""

    def __init__(self, file, where: str):
        super().__init__(file, fix_imports=False)
        self.where = where

    def find_class(self, module: str, name: str):
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise AutosplitError(f"{self.where}: refuses global '{module}.{name}' {_REFUSED}")


def read_metadata_file(path: str) -> Metadata:
    """DCP's ``Metadata`` from the ``.metadata`` file ``path``, through the allow-list."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except AutosplitError:
            raise
        except Exception as exc:          # truncated, not a pickle, a persistent id: not DCP's metadata
            raise AutosplitError(f"{path}: not a readable DCP metadata file ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise AutosplitError(f"{path}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _refused_global(data: bytes) -> str | None:
    """The first global of a ``torch.save`` zip that ``weights_only`` does not allow, if that is why it failed."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    except Exception:           # not a zip (a legacy or crafted file): torch's own message says more
        return None
    return sorted(unsafe)[0] if unsafe else None


def load_byte_entry(data: bytes):
    """One byte entry's value: ``torch.load(weights_only=True)``, BYTE_ENTRY_GLOBALS allowed besides torch's list.
    ``weights_only=True`` given explicitly: TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD does not override it."""
    with torch.serialization.safe_globals(list(BYTE_ENTRY_GLOBALS)):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def byte_entry_refusal(data: bytes, exc: BaseException, where: str) -> AutosplitError:
    """Why ``load_byte_entry(data)`` raised ``exc``: the global it refused, or torch's first line."""
    name = _refused_global(data)
    if name is not None:
        return AutosplitError(f"{where}: refuses global '{name}' {_REFUSED}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return AutosplitError(f"{where}: torch.load(weights_only=True) refuses it ({first})")


class _Refused(Exception):
    """A byte entry SafePlanner could not load; SafeReader, which knows the file, turns it into the AutosplitError."""

    def __init__(self, read_item, data: bytes, cause: BaseException):
        super().__init__(read_item.dest_index.fqn)
        self.read_item, self.data, self.cause = read_item, data, cause


class SafePlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` whose byte entries load with ``weights_only=True`` (its own uses
    ``weights_only=False``); the value goes where ``DefaultLoadPlanner.load_bytes`` puts it."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        data = value.read()
        try:
            loaded = load_byte_entry(data)
        except Exception as exc:
            raise _Refused(read_item, data, exc) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` that reads ``.metadata`` through the allow-list and its byte entries only
    with a SafePlanner.  Why a subclass and not a patch of DCP's ``pickle.load``: only autosplit's loads
    change, nothing else in the process that uses DCP."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        path = os.path.join(os.fspath(self.path), ".metadata" if rank is None else f"__{rank}.metadata")
        metadata = read_metadata_file(path)
        if getattr(metadata, "storage_meta", None) is None:     # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        if not isinstance(planner, SafePlanner):     # DCP's default planner would unpickle byte entries freely
            raise AutosplitError(f"SafeReader needs a SafePlanner, not a {type(planner).__name__}")
        try:
            return super().read_data(plan, planner)
        except _Refused as refused:
            info = self.storage_data[refused.read_item.storage_index]
            where = f"{os.path.join(os.fspath(self.path), info.relative_path)} (entry '{refused.args[0]}')"
            raise byte_entry_refusal(refused.data, refused.cause, where) from None


def load(state: dict, reader: SafeReader, **kwargs) -> None:
    """``dcp.load(state, ...)`` with ``reader`` and a SafePlanner.  A refusal on any rank reaches every rank
    (DCP gathers each rank's read error); it is raised as that AutosplitError (the lowest rank's) rather
    than DCP's CheckpointException."""
    try:
        dcp.load(state, storage_reader=reader, planner=SafePlanner(), **kwargs)
    except CheckpointException as exc:
        for rank in sorted(exc.failures):
            error = exc.failures[rank][0]
            if isinstance(error, AutosplitError):
                raise AutosplitError(str(error)) from None
        raise
