"""What the training loop trains: the pair objective (DPO family) and the unpaired one (KTO family) behind one
interface (``base.Objective``), the table of them (``registry``), what each ``train.objective`` is (``names``,
torch-free) and the choice for a config (``select``)."""

from __future__ import annotations

from prefpack.lazy import lazy_exports

# Loaded on first use (prefpack.lazy): the config reads the torch-free table `names` from this package.
_EXPORTS = {
    "OBJECTIVES": "prefpack.objectives.registry",
    "OBJECTIVE_NAMES": "prefpack.objectives.names",
    "TRAIN_OBJECTIVES": "prefpack.objectives.names",
    "KTOBatch": "prefpack.objectives.kto",
    "KTOStep": "prefpack.objectives.kto",
    "KTOTask": "prefpack.objectives.kto",
    "LossParams": "prefpack.objectives.settings",
    "Objective": "prefpack.objectives.base",
    "ObjectiveSpec": "prefpack.objectives.registry",
    "PairTask": "prefpack.objectives.pairs",
    "Planned": "prefpack.objectives.base",
    "RunSettings": "prefpack.objectives.settings",
    "StepState": "prefpack.objectives.base",
    "StepTotals": "prefpack.objectives.base",
    "Term": "prefpack.objectives.settings",
    "TrainObjective": "prefpack.objectives.names",
    "config_terms": "prefpack.objectives.settings",
    "make_objectives": "prefpack.objectives.select",
    "objective_for": "prefpack.objectives.registry",
    "open_store": "prefpack.objectives.select",
    "read_only_unpaired": "prefpack.objectives.registry",
    "release_images": "prefpack.objectives.base",
    "settings_from_config": "prefpack.objectives.settings",
    "train_objective": "prefpack.objectives.names",
    "trains_unpaired": "prefpack.objectives.registry",
    "uses_unpaired_loss": "prefpack.objectives.select",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
