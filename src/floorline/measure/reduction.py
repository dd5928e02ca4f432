"""What a quantised cell realises of the traffic reduction its format promises.

expected = reference floor / own floor (bytes a step must move, 16-bit over quantised);
realised = reference ms / own ms, the reference being the same runtime on 16-bit weights with
the same options, measured on the same environment, context, steps and warm-up;
share = realised time saving / expected time saving = (1 - own/ref ms) / (1 - own/ref floor),
so 100% means every byte saved came off the step, 0% none, and below 0 the step got slower.
"""

from __future__ import annotations

from dataclasses import replace

from floorline.paths import REGISTRY, PathSpec
from floorline.store import CellRow


def reference_path(path_spec: PathSpec) -> str | None:
    """`bnb-nf4+graphs` -> `hf-static+graphs`: the 16-bit path this one is measured against."""
    ref = REGISTRY[path_spec.base].reference
    return None if ref is None else replace(path_spec, base=ref).name


def reductions(rows: list[CellRow]) -> dict[int, dict]:
    """For each quantised row (by id) with a reference floor: expected, realised and share."""
    valid = {(r.model, r.ctx, r.path, r.steps, r.warmup, r.fingerprint_key): r
             for r in rows if r.status == "valid"}
    out = {}
    for r in rows:
        ref = r.details.get("reference")
        if not ref or not r.total_bytes:
            continue
        expected = ref["total_bytes"] / r.total_bytes
        entry = {"reference_path": ref["path"], "expected": expected, "realised": None,
                 "share": None, "reference_id": None}
        other = valid.get((r.model, r.ctx, ref["path"], r.steps, r.warmup,
                           r.fingerprint_key))
        if other is not None:
            entry["reference_id"] = other.id
        if other is not None and r.status == "valid":
            realised = other.median_ms / r.median_ms
            entry.update(realised=realised,
                         share=(1 - 1 / realised) / (1 - 1 / expected) if expected != 1 else None)
        out[r.id] = entry
    return out


def describe(entry: dict | None) -> str:
    """`3.52x / 1.21x (24%)`: expected / realised (share), for tables."""
    if entry is None:
        return ""
    text = f"{entry['expected']:.2f}x / "
    if entry["reference_id"] is None:
        return text + f"- (no valid {entry['reference_path']} cell)"
    if entry["realised"] is None:
        return text + "-"
    share = "" if entry["share"] is None else f" ({entry['share']:.0%})"
    return text + f"{entry['realised']:.2f}x{share}"
