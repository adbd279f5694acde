"""The OpenAI Agents SDK's chat-completions model (OpenAIChatCompletionsModel on an AsyncOpenAI
client at the proxy): stream usage only with ModelSettings(include_usage=True) off
api.openai.com."""

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from protocol import serve, usage

set_tracing_disabled(True)


def agent(step, responses: bool = False) -> Agent:
    """The chat-completions model, or (responses) the Responses API's, whose usage comes with
    every response.completed (include_usage is for chat completions)."""
    client = AsyncOpenAI(base_url=f"{step['base_url']}/v1", api_key=step["token"])
    kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    return Agent(
        name="assistant",
        instructions="You are a helpful assistant.",
        model=kind(model=step["model"], openai_client=client),
        model_settings=ModelSettings(include_usage=True),
    )


def answer(result) -> dict:
    u = result.context_wrapper.usage
    return {
        "text": result.final_output,
        "model": None,
        "usage": usage(u.input_tokens, u.output_tokens, u.total_tokens),
        "extra": {"requests": u.requests},
    }


async def text(step, responses: bool = False) -> dict:
    return answer(await Runner.run(agent(step, responses), step["prompt"]))


async def stream(step, responses: bool = False) -> dict:
    result = Runner.run_streamed(agent(step, responses), step["prompt"])
    async for _ in result.stream_events():
        pass
    return answer(result)


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


async def tool(step) -> dict:
    """An agent with a function tool on the Responses API model: the model calls the tool (the
    simulator calls the function its prompt names), the SDK runs it and sends its output back,
    the model answers."""
    client = AsyncOpenAI(base_url=f"{step['base_url']}/v1", api_key=step["token"])
    weather = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=step["model"], openai_client=client),
    )
    result = await Runner.run(weather, "Weather in Paris? sim:tool=get_weather sim:tokens=5")
    out = answer(result)
    out["extra"]["tool_outputs"] = [
        item.output for item in result.new_items if item.type == "tool_call_output_item"
    ]
    return out


serve(
    {
        "responses_tool": tool,
        "text": text,
        "stream": stream,
        "responses_text": lambda step: text(step, responses=True),
        "responses_stream": lambda step: stream(step, responses=True),
    }
)
