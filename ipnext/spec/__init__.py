"""What people write: the model spec and its snapshot sets (`model`), the fleet (`fleet`), the
DAG's checks (`dag`), sharded tables (`sharding`), the settings file ipnext.yaml (`settings`), the
demand file the planner reads (`demand_file`), and how every such file is read (`reading`).

Imports only `ipnext.errors`: a spec is checked where it is written, with no server in reach."""

__all__ = ["dag", "demand_file", "fleet", "model", "reading", "settings", "sharding"]
