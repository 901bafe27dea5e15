"""Type swaps of every key of a snapshot manifest, for tests/unit/snapshot/test_snapshot_fuzz.py:
each value replaced by values of the other JSON types, a NaN and a 10 001-digit integer
(``"@HUGE@"``, which the fuzz test's ``dump`` writes as digits), and the swaps the schema accepts by
design."""

import math

NAMED = ("layers", "shards")  # objects whose keys are names: their paths read ['name']


def child(path, key, named=False):
    if isinstance(key, int):
        return f"{path}[{key}]"
    if named or not key.isidentifier():
        return f"{path}[{key!r}]"
    return f"{path}.{key}" if path else key


def walk(value, path="", keys=()):
    """``(path string, key tuple)`` of every value below the top of the manifest."""
    if isinstance(value, dict):
        for k, v in value.items():
            p = child(path, k, named=path in NAMED)
            yield p, (*keys, k)
            yield from walk(v, p, (*keys, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            p = child(path, i)
            yield p, (*keys, i)
            yield from walk(v, p, (*keys, i))


def json_kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(v)]


# replacement values of every JSON type, a NaN and a 10 001-digit integer ("@HUGE@")
SWAPS = [None, [1], {"x": 1}, "eight", True, math.nan, "@HUGE@"]
# swaps the schema accepts by design (nullable or free-text keys): they must load
ACCEPTED = {("epoch", "null"), ("config.async_updates", "null"),
            ("config.output_dir", "string"),
            ("config.eval_prior_precision", "bool"),  # "auto", True or False
            ("model.model_type", "null"),  # a model whose config has no model_type
            ("run_plan.device_budget", "null"),  # "auto" on CUDA: decided at the first update
            ("run_plan.eigh_device", "null"),  # eigh_device="cpu": float64 on the CPU
            # a deferred eigendecomposition has no device, time or seconds
            ("eigen.device", "null"), ("eigen.finished_unix", "null"),
            ("eigen.seconds", "null")}


def swap_variants(manifest):
    out = []
    for path, keys in walk(manifest):
        obj = manifest
        for k in keys:
            obj = obj[k]
        for new in SWAPS:
            kind = "number" if new == "@HUGE@" or new is math.nan else json_kind(new)
            if kind == json_kind(obj) and not (new is math.nan or new == "@HUGE@"):
                continue
            out.append((path, keys, new, (path, kind) in ACCEPTED))
    return out


def set_at(m, keys, new):
    obj = m
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = new
