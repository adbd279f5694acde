"""The OpenAI Agents SDK's chat-completions model (OpenAIChatCompletionsModel on an AsyncOpenAI
client at the proxy): stream usage only with ModelSettings(include_usage=True) off
api.openai.com."""

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
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


serve(
    {
        "text": text,
        "stream": stream,
        "responses_text": lambda step: text(step, responses=True),
        "responses_stream": lambda step: stream(step, responses=True),
    }
)
