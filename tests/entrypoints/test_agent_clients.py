"""Agent libraries against `shoal serve` of the demo model (the session's server): a LangChain
tool round trip (`ChatOpenAI.bind_tools` -> a tool call -> a `ToolMessage` with its result -> the
final answer) and an openai-agents run with a forced function tool whose parameters are a
nested Pydantic model, through its chat-completions model class.

The demo model is small: the first turn forces the call (and bounds its strings), everything runs
at temperature 0 with few tokens, and the tests assert the protocol (a call comes back and
parses, the tool result is accepted, the answer is text), not what the model says."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, Field

from tests.entrypoints.server_utils import ServerProcess


class Place(BaseModel):
    # Bounded strings: a small model fills an unbounded one without end.
    city: str = Field(max_length=12, description="The city")
    country: str = Field(max_length=12, description="The country")


class Trip(BaseModel):
    """A trip from one place to another."""

    start: Place
    end: Place


QUESTION = "Plan a trip from Paris to Rome."


def test_langchain_tool_round_trip(server: ServerProcess) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import StructuredTool
    from langchain_openai import ChatOpenAI

    calls: list[Trip] = []

    def plan_trip(start: Place, end: Place) -> str:
        calls.append(Trip(start=start, end=end))
        return f"Booked: {start.city} to {end.city}, 3 hours by train."

    tool = StructuredTool.from_function(plan_trip, args_schema=Trip, description="Plan a trip")
    llm = ChatOpenAI(
        model=server.model_name,
        base_url=f"{server.url}/v1",
        api_key="EMPTY",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=80,  # type: ignore[call-arg]
        max_retries=0,
        timeout=120,
    )
    # "any" is LangChain's name for "required".
    forced = llm.bind_tools([tool], tool_choice="any", parallel_tool_calls=False)
    question = HumanMessage(QUESTION)
    ai = forced.invoke([question])
    assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "plan_trip"
    result = tool.invoke(ai.tool_calls[0])  # a ToolMessage with the call's id
    assert isinstance(result, ToolMessage) and len(calls) == 1
    # The second turn sends the AI message back with content null: the template must render it.
    answer = llm.bind_tools([tool]).invoke([question, ai, result], max_tokens=12)
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str) and answer.content
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_openai_agents_run_with_a_forced_function_tool(server: ServerProcess) -> None:
    """The SDK's function tool has a strict schema with `$defs` (`Trip`, `Place`) under
    `tool_choice: "required"`; the second turn sends the tool-call message without content."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # tracing would export to OpenAI's servers
    trips: list[Trip] = []

    @function_tool
    def plan_trip(trip: Trip) -> str:
        """Plan a trip.

        Args:
            trip: where it starts and ends.
        """
        trips.append(trip)
        return f"Booked: {trip.start.city} to {trip.end.city}."

    async def run() -> Any:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=120)
        try:
            agent = Agent(
                name="planner",
                instructions="You plan trips with the plan_trip tool.",
                model=OpenAIChatCompletionsModel(model=server.model_name, openai_client=client),
                tools=[plan_trip],
                # The first turn must call the tool; after it, the SDK resets tool_choice (to auto)
                # so that the second turn can answer in words.
                model_settings=ModelSettings(
                    tool_choice="required", temperature=0, max_tokens=64, parallel_tool_calls=False
                ),
            )
            return await Runner.run(agent, QUESTION, max_turns=3, run_config=RunConfig(tracing_disabled=True))
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(trips) == 1 and isinstance(trips[0], Trip)
    assert isinstance(result.final_output, str) and result.final_output
