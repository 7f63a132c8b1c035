"""Aliases that jax 0.11 removed from `jax.core` and that qkvflow's pinned dependencies still call.

marin-haliax 0.2.20 (which declares jax < 0.11) calls `jax.core.is_constant_dim` in
`haliax.jax_utils._jittable_dg_einsum`, through which every `hax.dot` and `hax.einsum` runs; marin-levanter's
Pallas autotuning calls `jax.core.unsafe_am_i_under_a_jit_DO_NOT_USE`. jax 0.10 serves both (deprecated)
from `jax._src.core`; jax 0.11 does not. `restore()` puts back each one that is missing, from `jax._src.core`
where it still lives (under the second's own name there, `unsafe_am_i_under_a_jit`). `is_constant_dim(d)` is true when `d` is a static integer dimension
(`operator.index(d)` succeeds), false for a symbolic one: jax's definition, written out here for a jax
that no longer has it at all. Applied when qkvflow is imported, on jax >= 0.11 only (jax 0.10 has them,
and checking would import jax, seconds, for every `import qkvflow`).
"""

import glob
import importlib.util
import operator
import os
import warnings

NAMES = {"is_constant_dim": "is_constant_dim", "unsafe_am_i_under_a_jit_DO_NOT_USE": "unsafe_am_i_under_a_jit"}
"""Name on jax.core -> the function's name in jax._src.core."""


def is_constant_dim(d) -> bool:
    """Whether `d` is a static integer dimension (not a symbolic one)."""
    try:
        operator.index(d)
    except Exception:
        return False
    return True


def jax_removed_them(version: str | None = None) -> bool:
    """Whether jax is 0.11 or later: `version`, else the installed one's, read from its `jax-X.Y.Z.dist-info`
    folder without importing jax or importlib.metadata (both cost a noticeable part of a second). True when
    it cannot tell (e.g. jax from a source checkout): `restore()` then checks `jax.core` itself."""
    if version is None:
        spec = importlib.util.find_spec("jax")
        if spec is None or not spec.submodule_search_locations:
            return False  # no jax
        site = os.path.dirname(list(spec.submodule_search_locations)[0])
        found = glob.glob(os.path.join(site, "jax-*.dist-info"))
        if len(found) != 1:
            return True
        version = os.path.basename(found[0])[len("jax-") : -len(".dist-info")]
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return True
    return (major, minor) >= (0, 11)


def restore() -> list[str]:
    """Put back each missing alias of NAMES on `jax.core`; the names restored (none on jax 0.10)."""
    try:
        import jax._src.core as src
        import jax.core as core
    except ImportError:  # no jax: nothing to restore, and nothing that needs it
        return []
    restored = []
    for name, source in NAMES.items():
        with warnings.catch_warnings():  # jax 0.10 serves them with a DeprecationWarning
            warnings.simplefilter("ignore")
            if hasattr(core, name):
                continue
        value = getattr(src, source, is_constant_dim if name == "is_constant_dim" else None)
        if value is not None:
            setattr(core, name, value)
            restored.append(name)
    return restored
