"""ValidateModelWorkflow: check a model spec on the worker before the model is registered.

The SDK and CLI run it (and wait for it) before they start the model's `ModelWorkflow`, so
the engineer's machine never imports the model's code and a spec the worker cannot serve
creates nothing. Its history is the record of the check: the error names the field and the fix.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import RETRY, VALIDATE_TIMEOUT
    from ipnext.activities.validate import validate_model_spec
    from ipnext.contracts.model import ValidateSpecInput

__all__ = ["ValidateModelWorkflow"]


@workflow.defn
class ValidateModelWorkflow:
    @workflow.run
    async def run(self, input: ValidateSpecInput) -> None:
        workflow.set_current_details(f"checking model {input.spec.name} against the fleet and its factories")
        await workflow.execute_activity(
            validate_model_spec,
            input,
            start_to_close_timeout=VALIDATE_TIMEOUT,
            retry_policy=RETRY,
            summary=f"check {input.spec.name}'s spec and factories",
        )
