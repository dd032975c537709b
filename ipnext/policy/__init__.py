"""Pure decisions: what a rollout step deploys and routes (`rollout_steps`) and whether its gates
pass (`gates`), whether an experiment's arm won (`experiments`), what a shadow's comparison says
(`shadow`), how light an update can be (`spec_update`), when a region is down and what to plan
without it (`regions`), and the demand observed against the demand declared (`demand`).

No Temporal, no Ray, no clock of their own: unit tests import them bare, and the workflows,
activities and routers call them."""

__all__ = ["demand", "experiments", "gates", "regions", "rollout_steps", "shadow", "spec_update"]
