"""The devices `qkvflow plan` compiles for, with the nominal numbers its roofline divides by.

A GPU target is an XLA `GpuTargetConfigProto` text (`specs/*.txtpb`, each naming its source in its
first lines) plus the datasheet numbers XLA does not hold: dense peak FLOP/s per compute dtype, and
the bandwidth one device has to the others, in one direction. A node is 8 GPUs (`devices_per_node`).
Within it, NVLink: NVLink 4 on the H100/H200 SXM, 900 GB/s both ways per GPU (450 one way); NVLink 3
on the A100 SXM4, 600 GB/s (300). Across nodes, the network: one NIC per GPU as in NVIDIA's DGX H100
and DGX A100 (8 x 400 Gb/s NDR InfiniBand ConnectX-7 per 8-GPU H100/H200 node, 50 GB/s per GPU; 8 x
200 Gb/s HDR ConnectX-6 per A100 node, 25 GB/s). f32 matmuls run at JAX's default precision, TF32
on these GPUs, so the f32 peak is the TF32 one. Sources: NVIDIA H100 and H200 product briefs (SXM:
989.4 TFLOP/s BF16 dense, 494.7 TF32 dense, NVLink 900 GB/s), NVIDIA A100 datasheet (SXM4 80GB: 312
BF16, 156 TF32, NVLink 600 GB/s), the NVIDIA DGX H100 and DGX A100 user guides (their NICs).

A TPU target is a slice of chips on ICI; a multi-slice program crosses slices over the data-centre
network (DCN). Google Cloud's TPU pages: v5e 197 TFLOP/s bf16, 16 GB HBM at 819 GB/s, ICI 400 GB/s
per chip both ways (one of its 4 links, one way: 50 GB/s), DCN 6.4 Tb/s per 256-chip pod (25 Gb/s,
3.125 GB/s per chip); v5p 459 TFLOP/s, 95 GiB at 2,765 GB/s, ICI 1,200 GB/s per chip both ways (one
of 6 links, one way: 100 GB/s), DCN 50 Gb/s (6.25 GB/s) per chip.

`cpu:N` is N host devices, the deviceless stand-in the default test suite compiles for: no peak and
no bandwidths (the roofline says n/a), and a nominal memory (`--device_memory` sets it).
"""

from __future__ import annotations

import dataclasses
import re
from importlib import resources
from pathlib import Path
from typing import Optional

from qkvflow.errors import UserError

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # "gpu", "tpu" or "cpu"
    memory_bytes: int
    peak_flops: dict  # compute dtype ("bfloat16", "float32") -> FLOP/s; empty: unknown
    hbm_bytes_per_s: Optional[float] = None
    link_bytes_per_s: Optional[float] = None  # to another device of the same node, one direction
    network_bytes_per_s: Optional[float] = None  # to a device of another node, one direction
    devices_per_node: int = 8
    spec: Optional[str] = None  # the GpuTargetConfigProto file under specs/, or an absolute path
    source: str = ""

    def spec_text(self) -> str:
        if Path(self.spec).is_absolute():
            return Path(self.spec).read_text()
        return resources.files("qkvflow.plan").joinpath("specs").joinpath(self.spec).read_text()


def _gpu(name, spec, memory, bf16, tf32, hbm, link, network, source):
    return Target(name, "gpu", memory, {"bfloat16": bf16, "float32": tf32}, hbm, link, network, 8, spec, source)


TARGETS = {
    "H100-80GB": _gpu(
        "H100-80GB", "h100_80gb.txtpb", 84_978_434_048, 989.4e12, 494.7e12, 3.35232e12, 450 * GB, 50 * GB,
        "XLA's h100_sxm.txtpb; NVIDIA H100 SXM product brief",
    ),
    "H200": _gpu(
        "H200", "h200.txtpb", 150_000_000_000, 989.4e12, 494.7e12, 4.8e12, 450 * GB, 50 * GB,
        "XLA's h100_sxm.txtpb with the H200's memory; NVIDIA H200 SXM product brief",
    ),
    "A100-80GB": _gpu(
        "A100-80GB", "a100_80gb.txtpb", 85_899_345_920, 312e12, 156e12, 2.039e12, 300 * GB, 25 * GB,
        "XLA's a100_40.txtpb with the 80GB part's memory; NVIDIA A100 datasheet",
    ),
}  # fmt: skip
"""Name -> GPU target. The memory is the spec's `device_memory_size`."""


def _tpu(name, generation, memory, bf16, hbm, ici, dcn, source):
    return Target(name, "tpu", memory, {"bfloat16": bf16, "float32": bf16}, hbm, ici, dcn, 1 << 30, generation, source)


TPUS = {
    "v5e": _tpu("v5e", "v5e", 16 * 2**30, 197e12, 819e9, 50 * GB, 3.125 * GB, "Google Cloud TPU v5e documentation"),
    "v5p": _tpu("v5p", "v5p", 95 * 2**30, 459e12, 2.765e12, 100 * GB, 6.25 * GB, "Google Cloud TPU v5p documentation"),
}  # fmt: skip
"""Name -> TPU target (a slice of chips, one "node"; `spec` is libtpu's generation name). The ICI
bandwidth is one link's, one direction (a ring collective runs over one link per neighbour), the DCN
one a chip's share of the network; f32 matmuls run as bfloat16 passes at JAX's default precision,
so one peak. No v4: libtpu's deviceless v4 topology gives two devices per chip (v4:2x2x1 has 8),
where a v4 VM runs one per chip (megacore)."""
TARGETS.update(TPUS)

CPU_MEMORY = 16 * 2**30
"""A `cpu:N` device's nominal memory (16 GiB) when `--device_memory` is not given."""


def known() -> list[str]:
    return [*TARGETS, "cpu:N"]


def get(name: str, device_memory: Optional[int] = None) -> Target:
    """The target `name` (a key of TARGETS, case-insensitive, or `cpu:N`); `device_memory` replaces its
    memory. An unknown name is refused in one line that lists the known ones."""
    match = re.fullmatch(r"cpu(?::(\d+))?", name.strip().lower())
    if match:
        target = Target(f"cpu:{match.group(1) or 1}", "cpu", CPU_MEMORY, {}, devices_per_node=1 << 30)
    else:
        found = {k.lower(): v for k, v in TARGETS.items()}.get(name.strip().lower())
        if found is None:
            raise UserError(f"--target {name!r} is unknown: expected one of {', '.join(known())}")
        target = found
    if device_memory is not None:
        if device_memory < 1:
            raise UserError(f"--device_memory={device_memory} is invalid: expected a number of bytes >= 1")
        target = dataclasses.replace(target, memory_bytes=int(device_memory))
    return target


def from_spec_file(path: str) -> Target:
    """A GPU target read from a `GpuTargetConfigProto` text file: its `device_memory_size`, and no
    datasheet numbers (peak, bandwidths: the roofline says n/a). A file that is missing or has no
    memory size is refused in one line."""
    file = Path(path).resolve()
    try:
        text = file.read_text()
    except OSError as e:
        raise UserError(f"--target {path}: cannot read it ({e.strerror})") from None
    memory = re.search(r"device_memory_size:\s*(\d+)", text)
    if memory is None:
        raise UserError(f"--target {path}: no device_memory_size; expected an XLA GpuTargetConfigProto text")
    return Target(path, "gpu", int(memory.group(1)), {}, spec=str(file), source=path)


def cpu_devices(target: Target) -> Optional[int]:
    """N of a `cpu:N` target; None for the others."""
    return int(target.name.split(":")[1]) if target.platform == "cpu" else None
