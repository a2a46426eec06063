"""The experiment config's schema: :class:`Config`, which holds one section per layer (data, model, loss, optim,
train, eval, distributed), and the checks across sections.

Why typed models and not a dict: every key has a type, a default, a one-line doc and (where it matters) a set of
valid choices or bounds, so a typo or a bad value fails at start-up with a message that names the key, the valid
choices and the closest match, instead of an hour into a cluster job. The models are pydantic's: each key's
documentation is its field's ``description``, its choices a ``Literal``, its bounds the field's, so the docs,
the checks, ``ddp-rank train --help-config`` and the JSON schema of the documentation never drift apart. The
sections live in the ``*_section`` modules (the checks a field's type cannot express are each section's model
validator); :mod:`ddp_rank.config.checks` holds what they share.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from ddp_rank.config.checks import ConfigError, _Model, _Section, _section_key
from ddp_rank.config.data_section import DataConfig
from ddp_rank.config.distributed_section import DistributedConfig
from ddp_rank.config.eval_section import EvalConfig
from ddp_rank.config.loss_section import LossConfig
from ddp_rank.config.model_section import ModelConfig
from ddp_rank.config.optim_section import OptimConfig
from ddp_rank.config.train_section import TrainConfig

__all__ = ["Config", "config_json_schema"]


class Config(_Model):
    """A whole experiment. Sections mirror the layers: data, model, loss, optim, train, eval, distributed."""

    data: DataConfig = Field(default_factory=DataConfig, description=DataConfig.__doc__)
    model: ModelConfig = Field(default_factory=ModelConfig, description=ModelConfig.__doc__)
    loss: LossConfig = Field(default_factory=LossConfig, description=LossConfig.__doc__)
    optim: OptimConfig = Field(default_factory=OptimConfig, description=OptimConfig.__doc__)
    train: TrainConfig = Field(default_factory=TrainConfig, description=TrainConfig.__doc__)
    eval: EvalConfig = Field(default_factory=EvalConfig, description=EvalConfig.__doc__)
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig, description=DistributedConfig.__doc__
    )

    @property
    def data_seed(self) -> int:
        """The seed of the data schedule, the dealing to ranks and the augmentations: ``data.seed``, or
        ``train.seed`` when it is -1 (so one seed varies everything, and ``data.seed`` varies the data alone)."""
        return self.data.seed if self.data.seed >= 0 else self.train.seed

    @model_validator(mode="after")
    def _check(self) -> Config:
        """Cross-section checks that no single section can make."""
        if self.data.resize_size < self.data.image_size:
            raise ConfigError(
                f"data.resize_size={self.data.resize_size} is smaller than data.image_size={self.data.image_size}; "
                "set resize_size >= image_size"
            )
        milestones = self.optim.step_milestones
        if milestones != sorted(milestones):
            raise ConfigError(f"optim.step_milestones={milestones} must be increasing")
        if len(self.optim.betas) != 2 or not all(b < 1 for b in self.optim.betas):
            raise ConfigError(
                f"optim.betas={self.optim.betas} must be two values in [0, 1), e.g. [0.9, 0.999]"
            )
        if len(set(self.eval.ks)) != len(self.eval.ks):
            raise ConfigError(f"eval.ks={self.eval.ks} lists a cut-off twice; list each k once")
        return self


_SECTIONS: dict[str, type[_Section]] = {
    _section_key(cls): cls
    for cls in (DataConfig, ModelConfig, LossConfig, OptimConfig, TrainConfig, EvalConfig, DistributedConfig)
}
"""The sections by key, in the order of :class:`Config` (the order of files, ``--help-config`` and messages)."""


def config_json_schema() -> dict[str, Any]:
    """The JSON schema of a config file (JSON Schema 2020-12, as pydantic writes it): each section a definition
    whose keys carry their type, default, ``description``, ``enum`` of choices and bounds; the documentation's
    generated config reference is built from it. Command-line text (``eval.ks=1,10``) is read into these types
    before the checks; the schema describes the values, as a YAML file writes them."""
    return Config.model_json_schema(mode="validation")
