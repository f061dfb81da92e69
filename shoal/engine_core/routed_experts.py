"""The routed experts a step recorded (`ModelRunnerOutput.routed_experts`) onto the outputs the
scheduler made of it: a request's experts travel with the output of the step that sampled its
token; a request that no longer runs (aborted meanwhile) drops them."""

from __future__ import annotations

from shoal.protocol import EngineCoreOutputs
from shoal.step import ModelRunnerOutput


def attach_routed_experts(outputs: EngineCoreOutputs, model_output: ModelRunnerOutput) -> EngineCoreOutputs:
    routed = model_output.routed_experts
    if routed:
        for output in outputs.outputs:
            output.new_routed_experts = routed.get(output.request_id)
    return outputs
