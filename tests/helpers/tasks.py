"""A supervised task from a whole config, as SupervisedTrainer builds it (rlhf.supervised.trainer: a task takes
the model, data and algorithm groups)."""


def make_task(cls, cfg, tokenizer):
    return cls(cfg.model, cfg.data, cfg.algorithm, tokenizer)
