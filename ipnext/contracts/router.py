"""The router's config as the workflows set it: per-set weights, the gated part, an experiment's arms and a
shadow's copy."""

from __future__ import annotations

from pydantic import Field, model_validator

from ipnext.names import Frozen

__all__ = ["ExperimentRoute", "RouterConfig", "ShadowRoute"]


class ExperimentRoute(Frozen):
    """A running experiment as routers draw it: a request that names its `unit` goes to the set app
    of the arm `experiments.assign_arm` gives that unit (sticky: a salted hash), and its answer
    carries the arm and a signed request id; a request without a unit runs as if there were no
    experiment (`RouterConfig.weights`)."""

    experiment: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    salt: str = Field(min_length=8)
    control: str
    arms: dict[str, str] = Field(min_length=2)  # arm -> set app
    split: dict[str, float]  # arm -> percent of units

    @model_validator(mode="after")
    def _arms_and_split_agree(self) -> ExperimentRoute:
        if self.control not in self.arms:
            raise ValueError(f"control: {self.control!r} is not one of the arms {sorted(self.arms)}")
        if set(self.split) != set(self.arms):
            raise ValueError(f"split: names the arms {sorted(self.split)}, the arms are {sorted(self.arms)}")
        if any(share < 0 for share in self.split.values()) or abs(sum(self.split.values()) - 100) > 1e-6:
            raise ValueError(f"split: shares of at least 0 that sum to 100, got {self.split}")
        return self


class ShadowRoute(Frozen):
    """A running shadow as routers mirror it: `percent` of the requests answered from the
    serving set are sent again, after the caller's answer, to the candidate's set app (`app`),
    whose answer is compared with the served one (`ipnext.policy.shadow`) and never returned. At most
    `max_in_flight` such calls per router replica at once: past that a mirrored request is
    dropped, and counted as dropped."""

    shadow: str = Field(pattern=r"^[a-z][a-z0-9-]*$")  # the shadow's name (an experiment's)
    app: str
    percent: float = Field(gt=0, le=100)
    max_in_flight: int = Field(default=8, ge=1, le=1000)
    top_k: int = Field(default=3, ge=1)  # a ranking answer's top k, for the overlap


class RouterConfig(Frozen):
    """The router app's user_config: applied in place by `reconfigure`, never restarting it.

    `weights` picks the set app that runs a request's DAG. A model with `sync: independent`
    rolls each changed part on its own: `parts` then gives that part its own weights (the part
    is called on the app drawn from them, the rest of the DAG on the app drawn from `weights`),
    and `gated_part` names the part whose app a request is counted against, so the rollout
    gates judge the snapshot that is moving."""

    generation: int = Field(ge=0)
    weights: dict[str, float]  # set app name -> percent of traffic
    parts: dict[str, dict[str, float]] = Field(default_factory=dict)  # part -> set app -> percent
    gated_part: str | None = None
    experiment: ExperimentRoute | None = None
    shadow: ShadowRoute | None = None  # never answers a caller: not in `weights`

    @model_validator(mode="after")
    def _gated_part_has_weights(self) -> RouterConfig:
        if self.gated_part is not None and self.gated_part not in self.parts:
            raise ValueError(f"gated_part {self.gated_part!r} has no weights in parts {sorted(self.parts)}")
        return self

    def apps(self) -> set[str]:
        """Every set app a request may reach (a shadow's as a copy, never for its answer)."""
        named = {a for a, w in self.weights.items() if w > 0}
        if self.shadow is not None:
            named.add(self.shadow.app)
        if self.experiment is not None:
            named |= {app for arm, app in self.experiment.arms.items() if self.experiment.split[arm] > 0}
        return named | {a for by_app in self.parts.values() for a, w in by_app.items() if w > 0}
