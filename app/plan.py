"""Memory per GPU for a job, per strategy and world size, and the parallelism it implies."""

from __future__ import annotations

from app.config import JobConfig


def choose_parallelism(cfg: JobConfig) -> tuple[str, str]:
    """(parallelism, why) for `training.parallelism: auto`; an explicit setting stands."""
    if cfg.training.parallelism != "auto":
        return cfg.training.parallelism, "set in the config"
    return "fsdp", "no memory plan yet: FSDP2"


def apply_parallelism(cfg: JobConfig) -> JobConfig:
    """The config with `auto` replaced by the plan's choice, decided once for the whole worker range."""
    parallelism, _ = choose_parallelism(cfg)
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"parallelism": parallelism})})
