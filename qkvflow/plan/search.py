"""`qkvflow plan --search`: compile the layouts a config could train with on N devices, rank those that fit.

A layout (`qkvflow.plan.layouts`: the mesh, FSDP, the per-device batch, remat) is what Levanter's
trainer config sets without changing the training itself.

Each candidate is compiled by `planner.plan` (the program `qkvflow train` would run). Per layout, the
whole batch per device first: if it fits, it is the layout's batch (a smaller b only adds accumulation
steps). If not, the accumulating batches (b below it), whose memory grows with b: a b that fits
answers for every smaller one, one that does not for every larger one (`next_batch`). The whole batch
is not of that family: the accumulator is one more copy of the gradients, so a smaller b can need more
memory than no accumulation (docs/plan.md has such a case). A layout whose arguments alone exceed the
memory fits at no b. Two layouts that are one program (FSDP off with one data-parallel device; a remat
value that equals another) are compiled once. Compiles stop at `max_compiles`, and the search says
which layouts it did not finish. JAX's persistent compilation cache (JAX_COMPILATION_CACHE_DIR) also
answers compiles made before, by an earlier search or plan.

Layouts are ranked by `estimate`, the one function through which a plan's time estimate (and its
error, where it has one) reaches the ranking.
"""

from __future__ import annotations

import math
import shlex
import sys

from qkvflow.errors import UserError
from qkvflow.plan import planner
from qkvflow.plan.layouts import Layout, batches, configured, layouts, overrides, parse_remat, remat_key, yaml_value
from qkvflow.plan.report import gib
from qkvflow.plan.targets import Target

MAX_COMPILES = 12


def estimate(plan: dict) -> dict:
    """The time estimate a layout is ranked by: {"step_s": seconds, "error": the relative band or None,
    "is": what it is}. The calibrated estimate where the target has a calibration
    (`plan["estimate"]["calibrated"]`, qkvflow.plan.calibration: the truth within step / (1 +- band)),
    else the plan's roofline, which carries no error band."""
    e = plan["estimate"]
    c = e.get("calibrated") or {}
    if c.get("calibrated"):
        return {
            "step_s": c["step_s"],
            "error": c["band"],
            "mfu": c["mfu"],
            "is": f"calibrated on {len(c['rows'])} measured steps",
        }
    why = f" ({c['why']})" if c.get("why") else ""
    what = "the roofline, not calibrated" + why if e["step_s"] is not None else "none for this target: ranked by batch"
    return {"step_s": e["step_s"], "error": None, "mfu": e.get("mfu"), "is": what}


def predicted_largest(known: dict, limit: int) -> float:
    """The largest batch a line through the compiles nearest the limit predicts to fit; with one, its
    bytes beyond the arguments (which do not change with b) scaled in proportion to b. `known`:
    batch -> (bytes, argument bytes)."""
    points = sorted(known.items(), key=lambda p: abs(p[1][0] - limit))[:2]
    if len(points) == 2:
        (b1, (m1, _)), (b2, (m2, _)) = points
        if m2 != m1 and (m2 - m1) / (b2 - b1) > 0:
            return b1 + (limit - m1) * (b2 - b1) / (m2 - m1)
    b1, (m1, fixed) = points[0]
    return b1 * (limit - fixed) / (m1 - fixed) if m1 > fixed else math.inf


def next_batch(values: list[int], known: dict, limit: int) -> int | None:
    """The next per-device batch of `values` (ascending) to compile, or None once the largest that fits
    is known. The largest first: the whole batch at once, no accumulation. If that does not fit, the
    accumulating ones (every smaller b), whose memory grows with b: the largest valid one predicted to
    fit between the largest seen to fit and the smallest seen not to (the smallest of them if none is
    predicted to). No batch fits once the arguments alone (state and batch, the same at every b: a lower
    bound of the total) exceed the limit. `known`: batch -> (bytes, argument bytes)."""
    top = values[-1]
    if top not in known:
        return top
    if known[top][0] <= limit or known[top][1] > limit:
        return None
    accumulating = {b: known[b] for b in values[:-1] if b in known}
    fit = max((b for b, (m, _) in accumulating.items() if m <= limit), default=0)
    over = min((b for b, (m, _) in accumulating.items() if m > limit), default=math.inf)
    inside = [b for b in values[:-1] if fit < b < over]
    if not inside:
        return None
    below = [b for b in inside if b <= predicted_largest(accumulating or known, limit)]
    return below[-1] if below else inside[0]


def described(layout: Layout, key: str | None) -> dict:
    return {"mesh": layout.axes, "fsdp": layout.fsdp, "remat": {key: layout.remat} if key else {}}


def row(layout: Layout, per_device: int, global_batch: int, key: str | None, plan: dict) -> dict:
    e = estimate(plan)
    return {
        **described(layout, key),
        "per_device": per_device,
        "microbatches": global_batch // (per_device * layout.data_parallel),
        "memory": plan["memory"]["total"],
        "arguments": plan["memory"]["arguments"],
        "fits": plan["fits"],
        "step_s": e["step_s"],
        "mfu": e.get("mfu"),
        "error": e["error"],
        "estimate_is": e["is"],
        "compile_s": plan["compile_s"],
        "overrides": overrides(layout, per_device, key),
    }


def rank_key(r: dict):
    """Best first: the lowest estimate (none last), then the largest batch."""
    return (r["step_s"] is None, r["step_s"] or 0.0, -r["per_device"])


def search(
    config,
    target: Target,
    devices: int,
    vocab: int,
    *,
    max_compiles: int = MAX_COMPILES,
    models=None,
    fsdp=(True, False),
    remats=None,
    plan_fn=planner.plan,
    progress=lambda n, cap, row: None,
) -> dict:
    """Compile `config`'s layouts on `devices` of `target` (at most `max_compiles` compiles, through
    `plan_fn`, `planner.plan`'s signature); the fitting ones ranked by `estimate`, best first.
    `progress(n, max_compiles, row)` is called after the n-th compile."""
    if max_compiles < 1:
        raise UserError(f"--search_max_compiles {max_compiles} is invalid: expected an integer >= 1")
    g = config.trainer.train_batch_size
    if not isinstance(g, int):
        raise UserError("trainer.train_batch_size: the search needs one batch size, not a schedule")
    key, _ = remat_key(config.model)
    todo, skipped = layouts(devices, config.model, models, fsdp, remats)
    limit, _ = planner.usable_memory(target)
    compiled, unreached = [], []
    out = {"target": target.name, "devices": devices, "model_type": type(config.model).__name__}
    out.update(global_batch=g, seq_len=config.model.max_seq_len, usable=limit, remat_key=key)
    for layout in todo:
        values = batches(g, layout.data_parallel)
        if not values:
            why = f"trainer.train_batch_size={g} does not divide over {layout.data_parallel} data-parallel devices"
            skipped.append((layout, why))
            continue
        known, rows = {}, []
        while (b := next_batch(values, known, limit)) is not None:
            if len(compiled) >= max_compiles:
                break
            candidate = configured(config, layout, b, key)
            try:
                plan = plan_fn(candidate, target, devices, vocab)
            except UserError as e:
                compiled.append(None)
                skipped.append((layout, str(e)))
                rows = None
                break
            m = plan["memory"]
            known[b] = (m["total"], m["arguments"])
            rows.append(row(layout, b, g, key, plan))
            compiled.append(rows[-1])
            progress(len(compiled), max_compiles, rows[-1])
        if rows is None:
            continue
        fitting = [r for r in rows if r["fits"]]
        if not fitting and next_batch(values, known, limit) is not None:
            unreached.append((layout, len(known)))  # the cap came first
            continue
        if not fitting and known[values[-1]][1] > limit:
            why = f"no per-device batch fits: the arguments alone (state and batch) take {gib(known[values[-1]][1])}"
            skipped.append((layout, f"{why} of {gib(limit)} usable"))
        if fitting:
            best = min(fitting, key=rank_key)
            best["largest_fitting_known"] = next_batch(values, known, limit) is None
        else:
            best = None
        for r in rows:
            r["best_of_layout"] = r is best
    ranked = sorted((r for r in compiled if r and r.get("best_of_layout")), key=rank_key)
    out["ranked"] = ranked
    out["not_fitting"] = [r for r in compiled if r and not r["fits"]]
    out["skipped"] = [{**described(lay, key), "why": why} for lay, why in skipped]
    out["not_compiled"] = [{**described(lay, key), "compiles": n} for lay, n in unreached]
    out["compiles"] = len(compiled)
    out["max_compiles"] = max_compiles
    return out


def _layout_words(r: dict, key: str | None) -> list[str]:
    mesh = r["mesh"]
    remat = [yaml_value(r["remat"][key])] if key else []
    return [f"{mesh['data']} x {mesh['replica']} x {mesh['model']}", "on" if r["fsdp"] else "off", *remat]


def milliseconds(s) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e3:,.1f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def text(out: dict, config_path: str | None = None) -> str:
    """The search as one screen: the ranking, then what did not fit, was skipped or was not reached."""
    key = out["remat_key"]
    head = ["rank", "data x replica x model", "FSDP", *([key] if key else []), "batch/device", "microbatches"]
    head += ["memory", "est. step", "error", "est. MFU"]
    rows = []
    for i, r in enumerate(out["ranked"], 1):
        mark = "" if r["largest_fitting_known"] else " (at least)"
        error = "none" if r["error"] is None else f"+-{r['error']:.0%}"
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.0%}"
        rows.append(
            [str(i), *_layout_words(r, key), f"{r['per_device']}{mark}", str(r["microbatches"])]
            + [gib(r["memory"]), milliseconds(r["step_s"]), error, mfu]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [
        f"layout search: {out['model_type']} on {out['devices']} x {out['target']}, global batch "
        f"{out['global_batch']} x {out['seq_len']} tokens; {gib(out['usable'])} usable per device",
        f"{out['compiles']} compiles of at most {out['max_compiles']} (--search_max_compiles)",
        "",
        "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
        *("  ".join(c.ljust(w) for c, w in zip(row_, widths)).rstrip() for row_ in rows),
    ]
    if not rows:
        lines.append("(no layout compiled fits)")
    else:
        lines.append(f"estimate: {out['ranked'][0]['estimate_is']}")
    for r in out["not_fitting"]:
        lines.append(f"does not fit: {', '.join(_layout_words(r, key))}, batch {r['per_device']}: {gib(r['memory'])}")
    for s in out["skipped"]:
        lines.append(f"skipped: {', '.join(_layout_words(s, key))}: {s['why']}")
    for s in out["not_compiled"]:
        n = s["compiles"]
        done = f" after {n} compile{'s' if n > 1 else ''} with no batch that fits" if n else ""
        lines.append(f"not searched (the compile cap was reached{done}): {', '.join(_layout_words(s, key))}")
    if rows:
        best = out["ranked"][0]["overrides"]
        config = f"--config_path {shlex.quote(config_path)} " if config_path else ""
        lines += ["", "best layout:", f"  qkvflow train {config}{best}"]
    return "\n".join(lines)


def report_progress(n: int, cap: int, r: dict) -> None:
    """One line on stderr per compile: a search takes minutes per compile on a GPU target."""
    fits = "fits" if r["fits"] else "does not fit"
    print(
        f"search: compile {n}/{cap}: {r['overrides']}: {gib(r['memory'])}, {fits}, est. "
        f"{milliseconds(r['step_s'])} (compiled in {r['compile_s']} s)",
        file=sys.stderr,
        flush=True,
    )


def options(args, config) -> dict:
    """`search`'s keyword arguments from `qkvflow plan`'s --search_* flags."""
    for flag, given in (("--max_batch", args.max_batch), ("--save_hlo", args.save_hlo)):
        if given:
            raise UserError(f"{flag} is for one plan: --search finds each layout's largest batch itself")
    models = None
    if args.search_model is not None:
        words = [w.strip() for w in args.search_model.split(",")]
        if not all(w.isdigit() and int(w) >= 1 for w in words):
            raise UserError(f"--search_model {args.search_model!r} is invalid: expected sizes such as 1,2,4")
        models = [int(w) for w in words]
    words = [w.strip().lower() for w in args.search_fsdp.split(",")]
    if not words or any(w not in ("on", "off") for w in words):
        raise UserError(f"--search_fsdp {args.search_fsdp!r} is invalid: expected on, off or on,off")
    fsdp = tuple(dict.fromkeys(w == "on" for w in words))
    key, _ = remat_key(config.model)
    remats = None if args.search_remat is None else parse_remat(args.search_remat, key)
    return {
        "max_compiles": args.search_max_compiles,
        "models": models,
        "fsdp": fsdp,
        "remats": remats,
        "progress": report_progress,
    }
