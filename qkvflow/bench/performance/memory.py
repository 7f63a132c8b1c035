"""Memory figures, each labelled with what it measures.

* `xla`: XLA's own accounting of a compiled step (arguments, outputs, temporaries), per program and
  on every backend; `temp_bytes` is what the step allocates beyond its inputs and outputs.
* `device_peak_bytes`: the device allocator's peak so far, None on the CPU (no allocator statistics).
* `process_peak`: the device allocator's peak (`device.memory_stats()`, GPU/TPU), or on CPU the
  process's resident-set high-water mark (`ru_maxrss`: the whole process, JAX runtime included).
"""

import resource
import sys

import jax


def xla_memory(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001  (not every backend implements it)
        return None
    if m is None:
        return None
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }
    out["total_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def _device_stats() -> dict | None:
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001  (the CPU backend has none, or raises)
        return None


def device_peak_bytes() -> int | None:
    """The default device allocator's high-water mark so far (`peak_bytes_in_use`), or None where JAX
    reports none (the CPU)."""
    stats = _device_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def process_peak() -> dict:
    device = jax.devices()[0]
    stats = _device_stats()
    if stats and "peak_bytes_in_use" in stats:
        return {
            "kind": f"{device.platform} allocator peak_bytes_in_use (whole process)",
            "bytes": int(stats["peak_bytes_in_use"]),
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return {"kind": "host resident-set peak ru_maxrss (whole process, JAX runtime included)", "bytes": int(rss)}
