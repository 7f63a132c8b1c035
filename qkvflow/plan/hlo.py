"""Reading an optimised XLA HLO module (`compiled.as_text()`): what runs, how often, and what it moves.

The counting rule (the one `qkvflow plan` and `benchmarks/kernel_count.py` report): launches as XLA's
GPU runtime issues them. After XLA's passes, each instruction of the entry computation is one kernel
launch (a `fusion`, a `custom-call` such as a cuBLAS GEMM or cuDNN's fused attention, a collective, a
copy, ...), except the ones that launch nothing (`FREE`: parameters, tuples, bitcasts, control flow,
the `-done` halves of async pairs). Control flow runs other computations, each launch weighted by
the runs of every computation around it (a loop in a loop: both trip counts):

- a `while` with a known trip count n (`backend_config={"known_trip_count":{"n":...}}`) runs its
  body n times and never its condition (xla/backends/gpu/runtime/while_thunk.cc, `WhileThunk::
  ExecuteOnStream`: the `trip_count_` branch runs only `body_executor_`);
- a `while` without one runs its condition before every iteration and once more to stop (n + 1
  times) and its body n times; after each condition the runtime copies the predicate to the host
  and blocks until the stream is done (`stream.Memcpy`, `BlockHostUntilDone` in the same function):
  n + 1 host synchronisations. n is `unknown_trip_count` (1 unless given; the callers pass a
  fixed-step ODE's `num_steps`, `qkvflow.plan.planner.unknown_trips`: diffrax's loops are of this
  kind); these loops are counted in `unknown_trip_counts`;
- a `conditional` copies its branch index to the host and blocks (conditional_thunk.cc): one host
  synchronisation, then one branch (the costliest is counted);
- a `call` and an `async-start` run their computation once, at the weight of the instruction.

A fused computation is part of its fusion's single kernel and is not walked. `once_per_step` is every
launch outside loops, inside called computations and branches too. XLA may still merge launches at
run time (CUDA graphs, command buffers): these are the kernels the program asks for, not a measured
count, and `host_syncs` the synchronisations its control flow forces (the end of the step is not one).

    count_kernels(text)  -> kernel launches and host synchronisations per step, fusions, custom calls, loops
    collectives(text)    -> per kind (all-gather, reduce-scatter, all-reduce, all-to-all,
                            collective-permute): count, bytes, group sizes, bytes that cross nodes

Collective bytes are the full array the collective produces or reduces, every operand of a combined
(tuple) collective included: an all-gather's result (operands x group size), the operands of the
others. Groups are read from every form XLA prints (qkvflow.plan.groups).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter

from qkvflow.plan import groups

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
    "f8e4m3fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
    "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
SHAPE = re.compile(r"\b(" + "|".join(sorted(DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")

FREE = frozenset(
    "parameter constant get-tuple-element tuple bitcast while conditional call after-all add-dependency "
    "opt-barrier partition-id replica-id domain async-start async-update get-dimension-size".split()
)
"""Opcodes that launch no kernel of their own (and every `...-done`)."""

COLLECTIVES = {
    op + start: op
    for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    for start in ("", "-start")
}
"""Opcode -> collective kind: the synchronous op and the `-start` of its asynchronous pair."""


def shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every array type `dtype[d0,d1,...]` in `text`, in order."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in SHAPE.findall(text)]


def nbytes(text: str) -> int:
    """Bytes of all the arrays typed in `text` (a tuple type sums its elements)."""
    return int(sum(DTYPE_BYTES[d] * math.prod(dims) for d, dims in shapes(text)))


@dataclasses.dataclass
class Instr:
    name: str
    type: str  # the result type, e.g. "f32[8,32]{1,0}" or "(s32[], f32[8])"
    opcode: str
    operands: str  # the text inside the parentheses: "f32[8]{0} %a, f32[8]{0} %b"
    attrs: str  # what follows them
    root: bool = False
    comp: str = ""  # the computation it belongs to

    def attr(self, key: str) -> str | None:
        """The value of `key=` in the attributes (a name, a {...} group or a quoted string)."""
        m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", self.attrs)
        if not m:
            return None
        return _balanced(self.attrs, m.end())

    def called(self, key: str) -> list[str]:
        value = self.attr(key)
        return [] if value is None else [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]

    def backend_config(self) -> dict:
        value = self.attr("backend_config")
        if value is None:
            return {}
        value = value.strip()
        if value.startswith('"'):
            value = json.loads(value)
        try:
            return json.loads(value)
        except (json.JSONDecodeError, TypeError):
            return {}

    def op_name(self) -> str:
        """The JAX name stack XLA keeps in `metadata={op_name="jit(step)/.../dot_general" ...}` (the
        scopes the instruction was traced under, `transpose(jvp(...))` for the backward pass); "" if none."""
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.attr("metadata") or "")
        return m.group(1) if m else ""

    def operand_names(self) -> list[str]:
        """The operands' names (with or without XLA's `%`; inline types dropped)."""
        return [part.split()[-1].lstrip("%") for part in split_top(self.operands)]


COMMENT = re.compile(r"/\*.*?\*/")
"""XLA's comments in an operand list: `/*index=5*/` before every fifth operand."""


def split_top(text: str) -> list[str]:
    """`text` split at its top-level commas (none inside brackets), comments dropped, parts stripped."""
    parts, depth, start = [], 0, 0
    text = COMMENT.sub("", text)
    for i, c in enumerate(text):
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _balanced(text: str, start: int) -> str:
    """The token of `text` at `start`: up to the next top-level comma, brackets and quotes kept whole."""
    depth, i, quoted = 0, start, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in "{([":
            depth += 1
        elif c in "})]":
            if depth == 0:
                break
            depth -= 1
        elif c == "," and depth == 0:
            break
        i += 1
    return text[start:i].strip()


INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def _instruction(line: str) -> Instr | None:
    m = INSTR.match(line)
    if not m:
        return None
    root, name, rest = m.group(1) is not None, m.group(2), m.group(3)
    if rest.startswith("("):  # a tuple type
        type_ = rest[: _close(rest, 0) + 1]
    else:
        type_ = rest.split(" ", 1)[0]
    rest = rest[len(type_) :].strip()
    om = re.match(r"([\w\-]+)\(", rest)
    if not om:
        return None
    opcode = om.group(1)
    end = _close(rest, om.end() - 1)
    return Instr(name, type_, opcode, rest[om.end() : end], rest[end + 1 :].lstrip(", "), root)


def _close(text: str, open_at: int) -> int:
    """The index of the bracket closing the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] in "({[":
            depth += 1
        elif text[i] in ")}]":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


@dataclasses.dataclass
class Module:
    computations: dict  # name -> list[Instr]
    entry: str
    num_partitions: int = 1

    def __post_init__(self):
        self.types = {c: {i.name: i.type for i in body} for c, body in self.computations.items()}

    def operand_types(self, instr: Instr) -> list[str]:
        """The types of `instr`'s operands (printed inline by some XLA versions, looked up otherwise)."""
        parts = split_top(instr.operands)
        if any(" " in p and SHAPE.search(p) for p in parts):  # "bf16[8]{0} %a": the type before the name
            return [p.rsplit(" ", 1)[0] for p in parts]
        table = self.types.get(instr.comp, {})
        return [table[n] for n in instr.operand_names() if n in table]

    def operand_bytes(self, instr: Instr) -> int:
        return sum(nbytes(t) for t in self.operand_types(instr))


def parse(text: str) -> Module:
    """The computations of an HLO module's text."""
    comps: dict = {}
    entry, current = None, None
    partitions = re.search(r"num_partitions=(\d+)", text)
    for line in text.splitlines():
        if current is None:
            m = HEADER.match(line)
            if m and not line.startswith("HloModule"):
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _instruction(line)
        if instr is not None:
            instr.comp = current
            comps[current].append(instr)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry, int(partitions.group(1)) if partitions else 1)


def trip_count(instr: Instr) -> int | None:
    n = instr.backend_config().get("known_trip_count", {}).get("n")
    return None if n is None else int(n)


def walk(
    module: Module, name: str | None = None, weight: int = 1, stats: dict | None = None, unknown: int = 1, loops=True
):
    """(instruction, times it runs per step) for every instruction that launches a kernel, by the rule of
    the module docstring; a loop without a known trip count is taken to run `unknown` times. `stats`
    collects `loops`, `unknown_trip_counts` and `host_syncs`; `loops=False` leaves loops out."""
    stats = stats if stats is not None else {}
    for instr in module.computations[name or module.entry]:
        op = instr.opcode
        if op == "while" and not loops:
            continue
        if op == "while":
            known = trip_count(instr)
            n = unknown if known is None else known
            body = instr.called("body")[0]
            per_iteration = sum(w for _, w in walk(module, body, 1, {}, unknown))
            stats.setdefault("loops", []).append(
                {"trip_count": n, "known": known is not None, "launches_per_iteration": per_iteration}
            )
            if known is None:
                stats["unknown_trip_counts"] = stats.get("unknown_trip_counts", 0) + 1
                _sync(stats, "while", weight * (n + 1))
                yield from walk(module, instr.called("condition")[0], weight * (n + 1), stats, unknown)
            yield from walk(module, body, weight * n, stats, unknown)
        elif op in ("call", "async-start"):
            for c in instr.called("to_apply") + instr.called("calls"):
                yield from walk(module, c, weight, stats, unknown, loops)
        elif op == "conditional":
            branches = instr.called("branch_computations") or (
                instr.called("true_computation") + instr.called("false_computation")
            )
            _sync(stats, "conditional", weight)
            best = max(branches, key=lambda b: sum(w for _, w in walk(module, b, 1, {}, unknown)), default=None)
            if best is not None:
                yield from walk(module, best, weight, stats, unknown, loops)
        elif op not in FREE and not op.endswith("-done"):
            yield instr, weight


def _sync(stats: dict, where: str, times: int) -> None:
    stats["host_syncs"] = stats.get("host_syncs", 0) + times
    stats.setdefault("host_syncs_by", {"while": 0, "conditional": 0})[where] += times


def _module(hlo) -> Module:
    return hlo if isinstance(hlo, Module) else parse(hlo)


def count_kernels(hlo, unknown_trip_count: int = 1) -> dict:
    """Kernel launches per step of an optimised HLO module (text or `parse`d), by the rule of the module
    docstring (`unknown_trip_count` for a loop XLA has none for): `launches` in all, `host_syncs` (the
    host synchronisations its loops and conditionals force; `host_syncs_by` them), `once_per_step` (outside loops),
    `static` (each instruction once), `fusions` (static), `custom_calls` (launches per target),
    `by_opcode` (launches), `loops` (trip count, whether XLA knows it, launches per iteration of the
    body) and `unknown_trip_counts`."""
    module = _module(hlo)
    stats: dict = {}
    launches, static, fusions = 0, 0, 0
    by_opcode, custom = Counter(), Counter()
    for instr, weight in walk(module, stats=stats, unknown=unknown_trip_count):
        launches += weight
        static += 1
        by_opcode[instr.opcode] += weight
        fusions += instr.opcode == "fusion"
        if instr.opcode == "custom-call":
            custom[(instr.attr("custom_call_target") or "?").strip('"')] += weight
    return {
        "launches": launches,
        "host_syncs": stats.get("host_syncs", 0),
        "host_syncs_by": stats.get("host_syncs_by", {"while": 0, "conditional": 0}),
        "once_per_step": sum(w for _, w in walk(module, unknown=unknown_trip_count, loops=False)),
        "static": static,
        "fusions": fusions,
        "custom_calls": dict(custom),
        "by_opcode": dict(by_opcode),
        "loops": stats.get("loops", []),
        "unknown_trip_counts": stats.get("unknown_trip_counts", 0),
    }


def group_size(instr: Instr, num_partitions: int) -> int:
    """Devices in each of the collective's groups (the largest, should they differ)."""
    return max(len(g) for g in groups.device_groups(instr.opcode, instr.attrs, num_partitions))


MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
"""A TPU multi-slice program's collective across slices: a `send` to the host's DCN runtime
(`is_host_transfer=true`) whose frontend attributes name the transfer, e.g. ALL_REDUCE. The program
itself is one slice's (its partitions are that slice's chips)."""


def collectives(hlo, unknown_trip_count: int = 1, nodes=None, slices: int = 1) -> dict:
    """Per collective kind: `count` (per step, loops weighted), `bytes` (per step: the arrays gathered
    or reduced, see the module docstring), `group_size` (the largest group seen), `group_sizes` (every
    size seen) and `network_bytes`, `network_count` (the part whose groups span two nodes; `nodes[d]`
    is partition d's node, None: one node). A TPU multi-slice program's transfers across its `slices`
    slices (`MEGASCALE`) count as their kind, in groups of `slices`, all of it across nodes."""
    module = _module(hlo)
    out: dict = {}
    for instr, weight in walk(module, unknown=unknown_trip_count):
        kind = COLLECTIVES.get(instr.opcode)
        megascale = MEGASCALE.search(instr.attrs) if instr.opcode == "send" else None
        if megascale:
            kind = megascale.group(1).lower().replace("_", "-")
            found = [list(range(slices))]
        elif kind is None:
            continue
        else:
            found = groups.device_groups(instr.opcode, instr.attrs, module.num_partitions)
        n = max(len(g) for g in found)
        size = module.operand_bytes(instr) * (n if kind == "all-gather" else 1)
        entry = out.setdefault(
            kind, {"count": 0, "bytes": 0, "group_size": 0, "group_sizes": [], "network_count": 0, "network_bytes": 0}
        )
        entry["count"] += weight
        entry["bytes"] += weight * size
        entry["group_size"] = max(entry["group_size"], n)
        entry["group_sizes"] = sorted(set(entry["group_sizes"]) | {n})
        if megascale or groups.crosses_nodes(found, nodes):
            entry["network_count"] += weight
            entry["network_bytes"] += weight * size
    return out
