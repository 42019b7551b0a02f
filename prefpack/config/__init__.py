"""One typed config tree for ``prefpack train CONFIG.yaml [key.sub=value ...]``.

``schema`` holds the tree (plain nested dataclasses), ``rules`` its value rules, ``io`` YAML and overrides, ``keys``
the suggestion for an unknown key.
Parsing (``load_config`` / ``config_from_dict``) checks keys and types only, so partial configs (tests,
``prefpack eval``) can be built; ``Config.validate()`` checks values and cross-field rules and is what
``train`` must call before doing any work. Import from here, not from the modules.
"""

from prefpack.config.io import (
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
    parse_override,
    save_config,
)
from prefpack.config.schema import (
    AttnImpl,
    Balance,
    Budget,
    Config,
    ConfigError,
    DataConfig,
    Device,
    DistributedConfig,
    DType,
    FDivergence,
    KLPairing,
    LoraConfig,
    LossConfig,
    LossTermConfig,
    MasterDType,
    ModelConfig,
    OptimConfig,
    ReferenceConfig,
    ReferenceMode,
    RunConfig,
    SaveDType,
    Schedule,
    Strategy,
    TrainConfig,
)

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoraConfig",
    "LossConfig",
    "LossTermConfig",
    "ModelConfig",
    "OptimConfig",
    "ReferenceConfig",
    "RunConfig",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "parse_override",
    "save_config",
    # choice types of the fields (commands.py reads FDivergence's choices)
    "AttnImpl",
    "Balance",
    "Budget",
    "DType",
    "Device",
    "FDivergence",
    "KLPairing",
    "MasterDType",
    "ReferenceMode",
    "SaveDType",
    "Schedule",
    "Strategy",
]
