"""The arrays a Levanter checkpoint holds and their shapes, read from metadata alone (no array data).

Two layouts exist:

* marin-levanter writes one OCDBT key-value store per checkpoint (`step-N/manifest.ocdbt` and `d/`),
  each array a zarr v3 array under its tree path (`model/token_embeddings/weight/zarr.json`);
* Levanter 1.2 wrote a folder per array with a zarr v2 `.zarray` file (`model/token_embeddings/weight/.zarray`).

    array_shapes("checkpoints/run/step-100")["model/token_embeddings/weight"] == (50304, 768)
    array_dtypes("checkpoints/run/step-100")["model/token_embeddings/weight"] == "float32"
"""

from __future__ import annotations

import json
import os

import fsspec


def is_ocdbt(checkpoint: str) -> bool:
    fs, root = fsspec.core.url_to_fs(str(checkpoint))
    return fs.exists(os.path.join(root, "manifest.ocdbt"))


def array_shapes(checkpoint: str) -> dict[str, tuple[int, ...]]:
    """{"model/...": shape} for every array of the checkpoint (a `step-N` folder)."""
    return {key: tuple(m["shape"]) for key, m in _metadata(checkpoint).items() if m.get("shape") is not None}


def array_dtypes(checkpoint: str) -> dict[str, str]:
    """{"opt_state/...": "float32"} for every array of the checkpoint: numpy's name of its stored dtype
    (zarr v3's `data_type`, or zarr v2's `dtype` such as "<f4")."""
    import numpy as np

    dtypes = {}
    for key, m in _metadata(checkpoint).items():
        name = m.get("data_type") or m.get("dtype")
        if isinstance(name, str):
            dtypes[key] = name if name == "bfloat16" else np.dtype(name).name
    return dtypes


def _metadata(checkpoint: str) -> dict[str, dict]:
    """{path: zarr metadata} for every array of the checkpoint."""
    if is_ocdbt(checkpoint):
        return _ocdbt_metadata(str(checkpoint))
    fs, root = fsspec.core.url_to_fs(str(checkpoint))
    found = {}
    for name in (".zarray", "zarr.json"):
        for file in fs.glob(os.path.join(root, "**", name)):
            with fs.open(file) as f:
                found[os.path.relpath(os.path.dirname(file), root)] = json.load(f)
    return found


def _ocdbt_metadata(checkpoint: str) -> dict[str, dict]:
    import tensorstore as ts
    from levanter.tensorstore_serialization import build_kvstore_spec

    store = ts.KvStore.open({"driver": "ocdbt", "base": build_kvstore_spec(checkpoint)}).result()
    found = {}
    for key in store.list().result():
        key = key.decode("utf-8")
        if key.endswith("/zarr.json"):
            found[key[: -len("/zarr.json")]] = json.loads(store.read(key).result().value)
    return found
