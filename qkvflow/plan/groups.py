"""The device groups of an XLA collective, read from its `replica_groups` (or `source_target_pairs`).

XLA prints a collective's groups in one of three forms (xla/hlo/ir/replica_group.cc, mesh_and_axis.cc):

    {{0,1},{2,3}}                  explicit lists; `{}` or none: one group of every device
    [G,S]<=[d0,d1,...]T(p0,...)    iota: arange(d0 x d1 ...) reshaped to (d0, d1, ...), transposed by
                                   p (no T: not transposed), read as G groups of S
    mesh['a'=4,'b'=2] {'a'}        mesh axes: the devices laid out on the mesh (row-major, or in the
                                   order `, device_ids=([4,2]T(1,0))` gives: an iota as above, or a
                                   list), one group per position on the other axes; a sub-axis
                                   'a':(k)m is the factor of size m of axis a after its first
                                   (major) factor of size k

A `collective-permute` has no groups but pairs (`source_target_pairs={{0,1},{1,2}}`): each pair is a
group of 2. The ids are the program's partitions (logical devices, `use_global_device_ids`).
"""

from __future__ import annotations

import math
import re

import numpy as np

IOTA = re.compile(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _close(text: str, at: int) -> int:
    """The index just past the bracket that closes the one at `at`."""
    depth = 0
    for i in range(at, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced brackets in {text[at : at + 80]!r}")


def groups_text(attrs: str, key: str = "replica_groups") -> str | None:
    """The text of `key=` in an instruction's attributes: a whole `{...}`, iota or `mesh[...] {...}`."""
    m = re.search(rf"(?:^|[\s,]){key}=", attrs)
    if not m:
        return None
    i = m.end()
    if attrs.startswith("{", i):
        return attrs[i : _close(attrs, i)]
    if attrs.startswith("[", i):
        iota = IOTA.match(attrs, i)
        if not iota:
            raise ValueError(f"{key}: unread iota form {attrs[i : i + 80]!r}")
        return iota.group(0)
    if attrs.startswith("mesh[", i):
        end = _close(attrs, i + 4)
        ids = re.match(r",\s*device_ids=\(", attrs[end:])
        if ids:
            end = _close(attrs, end + ids.end() - 1)
        axes = re.match(r"\s*\{", attrs[end:])
        if not axes:
            raise ValueError(f"{key}: a mesh without its axes in {attrs[i : i + 120]!r}")
        return attrs[i : _close(attrs, end + axes.end() - 1)]
    raise ValueError(f"{key}: unread form {attrs[i : i + 80]!r}")


def _iota(text: str) -> np.ndarray:
    """The device ids of an iota form, as (groups, size) (or flat, for a device order)."""
    m = IOTA.fullmatch(text.strip())
    if not m:
        raise ValueError(f"unread iota form {text!r}")
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


def _device_order(text: str, n: int) -> np.ndarray:
    """A mesh's device order: an iota `[r0,r1,...]T(p...)` (arange reshaped to r, transposed by p,
    flattened; `[dims]<=` before it is the shape, already given by the mesh) or a list of ids."""
    text = re.sub(r"^\[[\d,]+\]<=", "", text.strip())
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if m:
        dims = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        order = ids.transpose([int(x) for x in m.group(2).split(",")]) if m.group(2) else ids
    else:
        order = np.array([int(x) for x in text.split(",")])
    if order.size != n:
        raise ValueError(f"replica_groups: device_ids=({text}) does not hold the mesh's {n} devices")
    return order.reshape(-1)


def _explicit(text: str) -> list[list[int]]:
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", text[1:-1])]


def _mesh(text: str) -> list[list[int]]:
    """The groups of a `mesh[...] {...}` form (see the module docstring)."""
    head = re.match(r"mesh\[([^\]]*)\]", text)
    axes = [(name, int(size)) for name, size in re.findall(r"'?([^',=\s]+)'?=(\d+)", head.group(1))]
    names = [a for a, _ in axes]
    n = math.prod(s for _, s in axes)
    ids = re.search(r"device_ids=\((.*)\)\s*\{", text)
    order = _device_order(ids.group(1), n) if ids else np.arange(n)
    refs = []  # (axis index, pre, size): pre None for a whole axis
    for ref in re.findall(r"[^,\s{}]+", text[text.rindex("{") :]):
        m = re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", ref)
        if not m or m.group(1) not in names:
            raise ValueError(f"replica_groups: unread mesh axis {ref!r} in {text!r}")
        axis = names.index(m.group(1))
        refs.append((axis, int(m.group(2)), int(m.group(3))) if m.group(2) else (axis, None, None))
    # split each axis into the factors its sub-axes name, major first
    factors, where = [], {}
    for i, (_, size) in enumerate(axes):
        cuts = {1, size} | {p for a, p, _ in refs if a == i and p} | {p * s for a, p, s in refs if a == i and p}
        cuts = sorted(cuts)
        for lo, hi in zip(cuts, cuts[1:]):
            where[(i, lo)] = len(factors)
            factors.append(hi // lo)
        if size == 1:
            where[(i, 1)] = len(factors)
            factors.append(1)
    grouped = [where[(a, p if p else 1)] for a, p, _ in refs]
    for a, p, _ in refs:  # a whole axis split by another ref's sub-axis is refused rather than misread
        if p is None and sum(1 for b, q, _ in refs if b == a) > 1:
            raise ValueError(f"replica_groups: axis {names[a]!r} both whole and split in {text!r}")
    rest = [f for f in range(len(factors)) if f not in grouped]
    size = math.prod(factors[f] for f in grouped)
    return order.reshape(factors).transpose(rest + grouped).reshape(-1, size).tolist()


def device_groups(opcode: str, attrs: str, num_devices: int) -> list[list[int]]:
    """The groups of devices one collective runs over (see the module docstring)."""
    if opcode.startswith("collective-permute"):
        pairs = groups_text(attrs, "source_target_pairs")
        return _explicit(pairs) if pairs else [[0, 1]]
    text = groups_text(attrs)
    if text is None or text.replace(" ", "") in ("{}", "{{}}"):
        return [list(range(num_devices))]
    if text.startswith("{"):
        return _explicit(text)
    if text.startswith("["):
        return _iota(text).tolist()
    return _mesh(text)


def crosses_nodes(groups: list[list[int]], nodes) -> bool:
    """Whether any group holds devices of two nodes; `nodes[d]` is device d's node (None: one node)."""
    if nodes is None:
        return False
    return any(len({nodes[d] for d in g}) > 1 for g in groups)
