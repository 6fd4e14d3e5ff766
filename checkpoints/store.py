"""orbax storage of (params, cfg): a directory with `params/` (an orbax checkpoint of every array) and `jspec.json`
(the ModelConfig via `to_dict` and the params tree structure, so `load` rebuilds dicts, lists, `Int4Weight` leaves
and None zeros exactly). int4 weights are stored as their packed uint8 codes, bf16 scales and uint8 zeros: a round
trip is bit-identical. Format v2 lists each array's CRC-32 (zlib's, over its C-order bytes) and `load` checks every
array it restores against it: a data file damaged inside its length (four bytes inverted mid-file in the demo:
orbax decoded the zstd chunk without complaint) is an error naming the array, not different weights. v1
checkpoints (no checksums) still load, unchecked.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import urllib.parse
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints.hf import CheckpointError
from jspec import tensor_parallel
from jspec.config import ModelConfig
from pallas_kernels.int4 import Int4Weight

FORMAT = "jspec-params"
VERSION = 2
READ_VERSIONS = (1, 2)  # v1: no checksums
META_FILE = "jspec.json"
PARAMS_DIR = "params"


def save(out_dir: str | os.PathLike, params, cfg: ModelConfig) -> None:
    """Write params (a pytree of dicts / lists / tuples / arrays / Int4Weight / None) and cfg to a new out_dir."""
    out = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty; save writes a new directory")
    arrays: dict[str, jax.Array] = {}
    tree = _encode(params, "params", arrays)
    import orbax.checkpoint as ocp

    os.makedirs(out, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(out, PARAMS_DIR), arrays)
    checkpointer.wait_until_finished()
    meta = dict(format=FORMAT, version=VERSION, config=cfg.to_dict(), tree=tree)
    with open(os.path.join(out, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)


def load(ckpt_dir: str | os.PathLike, mesh=None) -> tuple[dict, ModelConfig]:
    """Read what `save` wrote -> (params, cfg); arrays land on the default device. mesh: a tensor-parallel mesh
    (`jspec.tensor_parallel`): the arrays are restored into host memory (JAX's CPU device), then each shard is
    placed on its device, so no accelerator holds more than its shards; the params come back stacked on it."""
    root = os.path.abspath(os.fspath(ckpt_dir))
    meta_path = os.path.join(root, META_FILE)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"cannot read {meta_path} (not a jspec checkpoint written by save?): {e}") from e
    if meta.get("format") != FORMAT or meta.get("version") not in READ_VERSIONS:
        raise CheckpointError(
            f"{meta_path}: format {meta.get('format')!r} v{meta.get('version')} is not {FORMAT} "
            f"v{' or v'.join(map(str, READ_VERSIONS))}"
        )
    import orbax.checkpoint as ocp

    cfg = ModelConfig.from_dict(meta["config"])
    if mesh is not None:  # a bad mesh or sizes it cannot split raise before any array is read
        tensor_parallel.shard_config(cfg, tensor_parallel.mesh_size(mesh))
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0] if mesh is None else _host_device())
    target, checksums = {}, {}
    _collect_specs(meta["tree"], target, checksums, sharding)
    if meta["version"] >= 2 and (unlisted := sorted(target.keys() - checksums.keys())):
        raise CheckpointError(f"{meta_path} lists array {unlisted[0]!r} without its crc32 (v2 lists one per array)")
    params_dir = os.path.join(root, PARAMS_DIR)
    checkpointer = ocp.StandardCheckpointer()
    _check_data_files(params_dir)
    _check_stored(checkpointer, params_dir, target, meta_path)
    try:
        arrays = checkpointer.restore(params_dir, target)
    except Exception as e:  # orbax / tensorstore: a data file missing or truncated, ...
        found = re.findall(r"'path': '(params[^'/]*)/?'", str(e))
        what = f"array {found[0]!r}" if found else "the arrays"
        first = str(e).strip().splitlines()[0].split(". See full")[0][:200]
        raise CheckpointError(
            f"{params_dir}: cannot read {what}: its data file is missing or damaged (orbax: {first})"
        ) from e
    _check_checksums(arrays, checksums, params_dir)
    params = _decode(meta["tree"], arrays)
    return (params if mesh is None else tensor_parallel.shard_params(params, cfg, mesh)), cfg


def _host_device():
    """JAX's CPU device, where `load(mesh=)` restores before placing the shards."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError as e:
        raise RuntimeError(
            "load(mesh=) restores into host memory first and needs JAX's CPU platform: include cpu in JAX_PLATFORMS"
        ) from e


def _check_stored(checkpointer, params_dir: str, target: dict, meta_path: str) -> None:
    """Every array jspec.json lists is stored with its shape and dtype (orbax's own metadata), before any read."""
    try:
        with _orbax_log_dropped(ORBAX_NO_METADATA):
            stored = checkpointer.metadata(params_dir).item_metadata
    except Exception as e:
        raise CheckpointError(f"{params_dir}: cannot read the orbax metadata: {str(e).splitlines()[0][:200]}") from e
    if stored is None:  # orbax returns None (and logs ORBAX_NO_METADATA) where _METADATA or _sharding is damaged
        raise CheckpointError(
            f"{params_dir}: cannot read the orbax metadata: its _METADATA or _sharding file is missing or damaged"
        )
    for name, spec in target.items():
        if name not in stored:
            raise CheckpointError(f"{meta_path} lists array {name!r}, which {params_dir} does not hold")
        have = stored[name]
        if tuple(have.shape) != spec.shape or jnp.dtype(have.dtype) != spec.dtype:
            raise CheckpointError(
                f"{meta_path} says array {name!r} is {spec.dtype.name} {list(spec.shape)}, but {params_dir} stores "
                f"{jnp.dtype(have.dtype).name} {list(have.shape)}"
            )


ORBAX_NO_METADATA = "Failed to get item metadata"  # the start of orbax's warning that the error below replaces


@contextlib.contextmanager
def _orbax_log_dropped(prefix: str):
    """Within the block, orbax's log records (absl's logger) starting with prefix are dropped: the one-line
    CheckpointError says what they would, and a CLI error stays one line."""

    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(prefix)

    logger = logging.getLogger("absl")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def crc32(array) -> int:
    """zlib's CRC-32 of an array's bytes in C order (native byte order: little-endian on every platform JAX runs
    on); a device array is copied to the host first."""
    host = np.ascontiguousarray(np.asarray(array))
    return zlib.crc32(host.reshape(-1).view(np.uint8))


def _check_checksums(arrays: dict, checksums: dict[str, int], params_dir: str) -> None:
    """Every restored array whose CRC-32 jspec.json lists has it; raises CheckpointError naming the arrays that do
    not (one array at a time on the host, so the check holds no second copy of the params)."""
    damaged = [name for name, expected in checksums.items() if crc32(arrays[name]) != expected]
    if not damaged:
        return
    shown = ", ".join(map(repr, damaged[:3])) + (f" and {len(damaged) - 3} more" if len(damaged) > 3 else "")
    subject = f"array {shown} does not" if len(damaged) == 1 else f"arrays {shown} do not"
    raise CheckpointError(f"{params_dir}: {subject} match the CRC-32 that jspec.json lists: the data is damaged")


def _check_data_files(params_dir: str) -> None:
    """Every value orbax stored out of line lies inside a data file that is there, whole, before any read: a deleted
    or truncated file raises CheckpointError naming its array. Checked from the OCDBT B+tree's references (file,
    offset, length; tensorstore's `ocdbt.dump`) against the files' sizes, reading no array data. Why before: a
    restore that fails on one array leaves orbax's reads of the others running on an event loop it has closed,
    and their errors print long after the one raised (hundreds of tracebacks under the one-line message). A
    file damaged inside its length is still found by the restore itself. A checkpoint without OCDBT (no
    manifest.ocdbt) has no such references: the restore checks it alone."""
    if not os.path.exists(os.path.join(params_dir, "manifest.ocdbt")):
        return
    import tensorstore as ts

    try:
        store = ts.KvStore.open(f"file://{params_dir}/").result()
        versions = ts.ocdbt.dump(store).result()["versions"]
        nodes = [versions[-1]["root"]["location"]] if versions else []
        while nodes:
            location = nodes.pop()
            _check_reference(params_dir, location, "the orbax index")
            for entry in ts.ocdbt.dump(store, location).result()["entries"]:
                if "location" in entry:  # an interior node's child
                    nodes.append(entry["location"])
                elif "indirect_value" in entry:
                    array = bytes(entry["key"]).decode(errors="replace").split("/")[0]
                    _check_reference(params_dir, entry["indirect_value"], f"array {array!r}")
    except CheckpointError:
        raise
    except Exception as e:  # tensorstore: the manifest or an index node unreadable
        raise CheckpointError(f"{params_dir}: cannot read the orbax index: {str(e).splitlines()[0][:200]}") from e


def _check_reference(params_dir: str, reference: str, what: str) -> None:
    """reference: an OCDBT indirect data reference "kind:base_path:relative_path:offset:length" (percent-encoded
    paths, relative to params_dir); raises CheckpointError naming `what` if its bytes are not all in the file."""
    match = re.fullmatch(r"[^:]+:([^:]*):([^:]*):([0-9]+):([0-9]+)", reference)
    if match is None:
        raise CheckpointError(f"{params_dir}: cannot read {what}: unrecognised data reference {reference!r}")
    base, relative, offset, length = match.groups()
    path = os.path.join(params_dir, urllib.parse.unquote(base), urllib.parse.unquote(relative))
    end = int(offset) + int(length)
    size = os.path.getsize(path) if os.path.isfile(path) else None
    if size is None or size < end:
        state = "is missing" if size is None else f"is truncated ({size} bytes; the data ends at byte {end})"
        raise CheckpointError(f"{params_dir}: cannot read {what}: its data file {path} {state}")


def _encode(node, path: str, arrays: dict) -> object:
    """Tree -> JSON structure; arrays go into `arrays` under their path."""
    if node is None:
        return None
    if isinstance(node, Int4Weight):
        fields = dict(packed=node.packed, scales=node.scales, zeros=node.zeros)
        return {"int4": {k: _encode(v, f"{path}.{k}", arrays) for k, v in fields.items()}}
    if isinstance(node, dict):
        for key in node:
            if not isinstance(key, str):
                raise TypeError(f"{path}: dict keys must be strings to be saved, got {key!r}")
        return {"dict": {k: _encode(v, f"{path}.{k}", arrays) for k, v in node.items()}}
    if isinstance(node, list | tuple):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_encode(v, f"{path}.{i}", arrays) for i, v in enumerate(node)]}
    if isinstance(node, jax.Array | np.ndarray | np.generic):
        if path in arrays:
            raise ValueError(f"two params share the storage name {path!r} (a dict key containing '.')")
        arrays[path] = jnp.asarray(node)
        stored = arrays[path]  # as stored: JAX's dtype (a float64 numpy array is float32 without x64)
        return {"array": path, "shape": list(stored.shape), "dtype": stored.dtype.name, "crc32": crc32(stored)}
    raise TypeError(f"{path}: cannot save a {type(node).__name__} (expected arrays, Int4Weight, dict, list, tuple)")


def _collect_specs(tree, target: dict, checksums: dict, sharding) -> None:
    """From the JSON structure: the abstract restore target {path: ShapeDtypeStruct} and the CRC-32s {path: int} it
    lists (none in v1)."""
    if tree is None:
        return
    if "array" in tree:
        target[tree["array"]] = jax.ShapeDtypeStruct(tuple(tree["shape"]), jnp.dtype(tree["dtype"]), sharding=sharding)
        if "crc32" in tree:
            checksums[tree["array"]] = tree["crc32"]
        return
    ((kind, body),) = tree.items()
    for child in body.values() if isinstance(body, dict) else body:
        _collect_specs(child, target, checksums, sharding)


def _decode(tree, arrays: dict):
    if tree is None:
        return None
    if "array" in tree:
        return arrays[tree["array"]]
    ((kind, body),) = tree.items()
    if kind == "int4":
        return Int4Weight(**{k: _decode(v, arrays) for k, v in body.items()})
    if kind == "dict":
        return {k: _decode(v, arrays) for k, v in body.items()}
    children = [_decode(v, arrays) for v in body]
    return children if kind == "list" else tuple(children)
