"""The single-field rules of `KDAHybridConfig`: `field(default, rule)` declares a field with its rule, and
`rule(name, value)` raises the ValueError every config refusal uses (`fail`: the field, what it must be, what it
was). Nothing here knows the config's fields."""

from __future__ import annotations

import dataclasses
import math


def fail(name, expected, got):
    raise ValueError(f"KDAHybridConfig: {name} must be {expected}, got {got!r}")


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, never a size or a token id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


# The largest KDA head dim the Triton kernels take: kda_triton_fwd.MAX_HEAD_DIM (they hold a head's K = V in one
# register tile). Checked here so a config that cannot run on GPU fails at construction, not in a kernel launch.
MAX_LINEAR_HEAD_DIM = 256


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def positive_int(name, value):
    if not (is_int(value) and value > 0):
        fail(name, "a positive int", value)


def linear_head_dim(name, value):
    positive_int(name, value)
    if value > MAX_LINEAR_HEAD_DIM:
        fail(name, f"<= {MAX_LINEAR_HEAD_DIM} (the Triton KDA kernels hold a head in registers)", value)


def non_negative_int(name, value):
    if not (is_int(value) and value >= 0):
        fail(name, "an int >= 0", value)


def boolean(name, value):
    if not isinstance(value, bool):
        fail(name, "True or False", value)


def real(expected, ok):
    """A rule: a finite number for which ok(value) holds."""
    def rule(name, value):
        if not (_is_real(value) and math.isfinite(value) and ok(value)):
            fail(name, expected, value)
    return rule


def one_of(*choices, shown=None):
    def rule(name, value):
        if value not in choices:
            fail(name, shown or " or ".join(map(repr, choices)), value)
    return rule


def optional(check):
    """None, or what `check` accepts."""
    def rule(name, value):
        if value is not None:
            check(name, value)
    return rule


def layer_types(name, value):  # its length is validate_layers'
    if not isinstance(value, list):
        fail(name, "a list of 'linear_attention' / 'full_attention' entries, one per layer", value)


def field(default, rule=None):
    """A config field with its single-field rule."""
    return dataclasses.field(default=default, metadata={"rule": rule} if rule else {})
