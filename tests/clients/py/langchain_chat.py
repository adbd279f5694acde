"""langchain-openai's ChatOpenAI: stream usage only with stream_usage=True."""

from langchain_openai import ChatOpenAI
from protocol import serve, usage


def chat(step, stream_usage: bool = True) -> ChatOpenAI:
    return ChatOpenAI(
        model=step["model"],
        base_url=f"{step['base_url']}/v1",
        api_key=step["token"],
        stream_usage=stream_usage,
    )


def from_message(message) -> dict:
    u = message.usage_metadata
    return {
        "text": message.content,
        "model": message.response_metadata.get("model_name"),
        "usage": u and usage(u["input_tokens"], u["output_tokens"], u["total_tokens"]),
    }


def text(step) -> dict:
    return from_message(chat(step).invoke(step["prompt"]))


def stream(step, stream_usage: bool = True) -> dict:
    whole = None
    for chunk in chat(step, stream_usage).stream(step["prompt"]):
        whole = chunk if whole is None else whole + chunk
    return from_message(whole)


serve({"text": text, "stream": stream, "stream_no_usage": lambda step: stream(step, False)})
