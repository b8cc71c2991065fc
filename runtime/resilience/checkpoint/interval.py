"""How often to checkpoint: the Young/Daly interval from the measured stall and the stated MTBF
(docs/design.md §7), and the duration syntax of --mtbf."""

from __future__ import annotations

import math
import re

from runtime.errors import FlagError


def young_daly_interval(stall_s: float, mtbf_s: float, step_time_s: float) -> tuple[int, dict]:
    """Checkpoint every K steps with K * step_time ~ sqrt(2 * stall * MTBF) (Young/Daly).
    Returns K and the figures to log: tau_s, overhead (stall/tau), expected_rework_s (tau/2 per
    failure) and the expected fraction of time lost, stall/tau + tau/(2 MTBF)."""
    tau = math.sqrt(2.0 * max(stall_s, 1e-9) * mtbf_s)
    k = max(1, int(round(tau / max(step_time_s, 1e-9))))
    tau_k = k * step_time_s
    return k, {"tau_s": tau_k, "young_daly_s": tau, "overhead": stall_s / tau_k,
               "expected_rework_s": tau_k / 2.0,
               "expected_lost_fraction": stall_s / tau_k + tau_k / (2.0 * mtbf_s)}


def _not_a_duration(text: str) -> FlagError:
    return FlagError(f"--mtbf {text!r} is not a duration: write a number and a unit s, m, h or d, e.g. 90m, 6h or 2d")


def parse_duration_s(text: str) -> float:
    """Seconds of an --mtbf duration: a number > 0 with an optional unit s, m, h or d ("6h");
    anything else a FlagError naming the text and the form."""
    match = re.fullmatch(r"\s*(-?)\s*([0-9.]+)\s*([smhd]?)\s*", str(text))
    if not match:
        raise _not_a_duration(text)
    try:
        value = float(match.group(2))
    except ValueError:  # "1.2.3"
        raise _not_a_duration(text) from None
    if match.group(1) or value <= 0:  # a failure every 0 s would checkpoint after every step and still be a lie
        raise FlagError(f"--mtbf {text!r}: the mean time between failures must be more than 0: write e.g. 6h")
    return value * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(3)]
