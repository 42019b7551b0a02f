"""Reading a sharded (torch.distributed.checkpoint) checkpoint without running anything that is in it.

torch 2.13 reads ``dcp/.metadata`` with plain ``pickle.load`` (FileSystemReader.read_metadata) and the values that
are not tensors (the optimizer's param_groups) with ``torch.load(weights_only=False)`` (DefaultLoadPlanner.
load_bytes): a crafted checkpoint would run code on ``--resume``, and checksums.json cannot stop that (whoever
can write the file can rewrite its checksum). Here the metadata is unpickled by an Unpickler that builds only the
classes DCP's Metadata is made of, its shape is checked (every data file a plain name inside the folder, no
stream transforms), and the non-tensor values are read with ``weights_only=True`` (tensors already are). Anything
else raises `CheckpointRefused`, which the resume treats like a damaged checkpoint (set aside, the previous one
used).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from prefpack.training.checkpoint.files import CheckpointDamaged

METADATA = ".metadata"
_DCP_META = "torch.distributed.checkpoint.metadata"

# (module, name) of every global a .metadata written by torch 2.13's FileSystemWriter refers to (checked with
# pickletools on FSDP2 and single-process checkpoints), plus the harmless value types DCP may also use. Every one
# is a plain data class or a lookup of a constant: none runs anything when called with the pickle's arguments.
ALLOWED = frozenset({
    (_DCP_META, "Metadata"), (_DCP_META, "StorageMeta"), (_DCP_META, "MetadataIndex"),
    (_DCP_META, "TensorStorageMetadata"), (_DCP_META, "BytesStorageMetadata"), (_DCP_META, "ChunkStorageMetadata"),
    (_DCP_META, "TensorProperties"), (_DCP_META, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),  # torch's own pickling of torch.layout
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32 ... pickle as `torch NAME`


class CheckpointRefused(CheckpointDamaged):
    """A checkpoint file that holds something prefpack never writes (code to run, a path outside the checkpoint)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it asks to build {module}.{name}, which a checkpoint's metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("it refers to persistent objects, which a checkpoint's metadata never holds")


def read_dcp_metadata(folder: Path):
    """The Metadata of the DCP folder ``folder`` (``dcp/`` of a checkpoint), unpickled with only the classes it is
    made of and checked; `CheckpointRefused` naming the file otherwise."""
    path = Path(folder) / METADATA
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointRefused(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        meta = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - every failure of a crafted or damaged file is the same refusal
        raise CheckpointRefused(f"{path}: refused, not a checkpoint metadata file prefpack writes: "
                                f"{' '.join(str(exc).split())[:300]}") from exc
    problem = _shape_problem(meta, Path(folder))
    if problem:
        raise CheckpointRefused(f"{path}: refused, not a checkpoint metadata file prefpack writes: {problem}")
    return meta


def _shape_problem(meta: Any, folder: Path) -> str | None:
    """Why ``meta`` is not the Metadata DCP writes (None when it is): the types of its entries, and each data file
    a plain name of a file in ``folder`` read without transforms."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if not isinstance(meta, Metadata):
        return f"it holds a {type(meta).__name__}, not a Metadata"
    entries, storage = meta.state_dict_metadata, meta.storage_data
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "its entries are not mappings"
    for key, entry in entries.items():
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata | BytesStorageMetadata):
            return f"entry {key!r} is a {type(entry).__name__}"
        if isinstance(entry, TensorStorageMetadata) and not _tensor_entry_ok(entry):
            return f"entry {key!r} has a malformed tensor description"
    files = {p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink()}
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return f"its storage table holds a {type(info).__name__}"
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
            return f"entry {index.fqn!r} is read from {name!r}, not a file of the checkpoint's folder"
        if name not in files:
            return f"entry {index.fqn!r} is read from {name}, which is not a file of the checkpoint's folder"
        if not all(type(v) is int and v >= 0 for v in (info.offset, info.length)):
            return f"entry {index.fqn!r} has no valid offset and length"
        if info.transform_descriptors:
            return f"entry {index.fqn!r} asks for stream transforms {info.transform_descriptors!r}"
    return None


def _tensor_entry_ok(entry) -> bool:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    props = entry.properties
    return (isinstance(props, TensorProperties) and isinstance(props.dtype, torch.dtype)
            and isinstance(entry.size, torch.Size) and isinstance(entry.chunks, list)
            and all(isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size) for c in entry.chunks))


def load_dcp(state_dict: dict, folder: Path, metadata) -> None:
    """``dcp.load`` of ``folder`` into ``state_dict`` with ``metadata`` from `read_dcp_metadata` (never unpickled
    again) and the values that are not tensors read with ``weights_only=True``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=_reader(folder, metadata), planner=_planner(Path(folder)))


def _reader(folder: Path, metadata):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class CheckedReader(FileSystemReader):
        """A FileSystemReader that hands out the checked metadata instead of unpickling ``.metadata``. Its
        ``read_metadata`` takes no ``rank``, so dcp.load never falls back to per-rank metadata files."""

        def read_metadata(self):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
            return metadata

    return CheckedReader(str(folder))


def _planner(folder: Path):
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose non-tensor values (lr, betas, ...) are read with ``weights_only=True``."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True, map_location="cpu")
            except (pickle.UnpicklingError, RuntimeError, EOFError) as exc:
                name = self.metadata.storage_data[read_item.storage_index].relative_path
                raise CheckpointRefused(f"{folder / name}: refused, entry {read_item.dest_index.fqn!r} holds more "
                                        f"than plain values ({' '.join(str(exc).split())[:200]})") from exc
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return WeightsOnlyPlanner()
