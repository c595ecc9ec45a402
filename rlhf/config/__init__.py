from rlhf.config.cli import build_config, load_yaml, main_entry, make_command, parse
from rlhf.config.schema import (
                     GROUPS,
                     AlgorithmConfig,
                     CheckpointConfig,
                     DataConfig,
                     LoggingConfig,
                     ModelConfig,
                     OptimConfig,
                     RolloutConfig,
                     TopologyConfig,
                     TrainConfig,
                     flag_index,
)
from rlhf.config.validate import ConfigError, validate

__all__ = ["GROUPS", "AlgorithmConfig", "CheckpointConfig", "DataConfig", "LoggingConfig", "ModelConfig",
           "OptimConfig", "RolloutConfig", "TopologyConfig", "TrainConfig", "flag_index", "ConfigError",
           "validate", "build_config", "load_yaml", "make_command", "parse", "main_entry"]
