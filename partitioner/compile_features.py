"""The compile's side of the training features (Note [one feature, one module] in
runtime/features/__init__.py): what they decide on the solved layout and what they cost a step."""

from __future__ import annotations

import importlib

from partitioner.config.settings import Decisions, TrainingSettings
from runtime.features.base import Layout, PriceFacts
from runtime.features.registry import FEATURES, asked


def feature_sharding(settings: TrainingSettings, shard: str) -> str:
    """The sharding request (auto | on | off) once every feature has read its settings."""
    for feature in FEATURES:
        shard = feature.sharding(asked(feature, settings.features), shard)
    return shard


def feature_decisions(settings: TrainingSettings, assignment, tp: int, sharded: bool) -> dict:
    """What each feature decides on the solved layout; what the runtime cannot run is refused here
    (Note [one feature, one module] in runtime/features/__init__.py)."""
    layout = Layout(dp=assignment.dp, tensor_parallel=tp, sharded=sharded, schedule=assignment.pipeline_schedule,
                    local_stages=assignment.num_stages // assignment.pipeline_ranks)
    decided: dict = {}
    for feature in FEATURES:
        decided.update(feature.decide(asked(feature, settings.features), layout))
    return decided


def feature_prices(stages, cluster, assignment, tp: int, decisions: Decisions) -> tuple[float, dict]:
    """(seconds the features add to the step, their "predicted" entries): Note [feature pricing]."""
    dp_links = [link for s in range(assignment.num_stages)
                if (link := cluster.slowest_link(assignment.device_of_stage_replica[s])) is not None]
    facts = PriceFacts(stages=tuple(stages), world_size=assignment.pipeline_ranks * assignment.dp * tp,
                       latency_s=max((k.latency_s for k in dp_links), default=0.0),
                       bandwidth_bytes_per_s=min((k.bandwidth_bytes_per_s for k in dp_links), default=1e9))
    seconds, entries = 0.0, {}
    for feature in FEATURES:
        if feature.pricing:  # a module of partitioner/solver/, named by path (Note [feature pricing])
            extra, said = importlib.import_module(feature.pricing).predicted(asked(feature, decisions.features),
                                                                             facts)
            seconds, entries = seconds + extra, {**entries, **said}
    return seconds, entries
