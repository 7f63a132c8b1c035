"""The arrays a Levanter checkpoint holds and their shapes, read from metadata alone (no array data).

Two layouts exist:

* marin-levanter writes one OCDBT key-value store per checkpoint (`step-N/manifest.ocdbt` and `d/`),
  each array a zarr v3 array under its tree path (`model/token_embeddings/weight/zarr.json`);
* Levanter 1.2 wrote a folder per array with a zarr v2 `.zarray` file (`model/token_embeddings/weight/.zarray`).

    array_shapes("checkpoints/run/step-100")["model/token_embeddings/weight"] == (50304, 768)
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
    if is_ocdbt(checkpoint):
        return _ocdbt_shapes(str(checkpoint))
    fs, root = fsspec.core.url_to_fs(str(checkpoint))
    shapes = {}
    for name in (".zarray", "zarr.json"):
        for file in fs.glob(os.path.join(root, "**", name)):
            with fs.open(file) as f:
                shape = json.load(f).get("shape")
            if shape is not None:
                shapes[os.path.relpath(os.path.dirname(file), root)] = tuple(shape)
    return shapes


def _ocdbt_shapes(checkpoint: str) -> dict[str, tuple[int, ...]]:
    import tensorstore as ts
    from levanter.tensorstore_serialization import build_kvstore_spec

    store = ts.KvStore.open({"driver": "ocdbt", "base": build_kvstore_spec(checkpoint)}).result()
    shapes = {}
    for key in store.list().result():
        key = key.decode("utf-8")
        if key.endswith("/zarr.json"):
            metadata = json.loads(store.read(key).result().value)
            shapes[key[: -len("/zarr.json")]] = tuple(metadata["shape"])
    return shapes
