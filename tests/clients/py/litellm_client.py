"""litellm as a client SDK (`openai/` + the model, api_base at the proxy): stream usage with
stream_options={"include_usage": True}."""

import litellm
from protocol import serve, usage

litellm.suppress_debug_info = True


def call(step, **kwargs):
    return litellm.completion(
        model=f"openai/{step['model']}",
        api_base=f"{step['base_url']}/v1",
        api_key=step["token"],
        messages=[{"role": "user", "content": step["prompt"]}],
        **kwargs,
    )


def text(step) -> dict:
    answer = call(step)
    u = answer.usage
    return {
        "text": answer.choices[0].message.content,
        "model": answer.model,
        "usage": u and usage(u.prompt_tokens, u.completion_tokens, u.total_tokens),
    }


def stream(step) -> dict:
    parts, model, u = [], None, None
    for chunk in call(step, stream=True, stream_options={"include_usage": True}):
        model = chunk.model or model
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None) is not None:
            u = chunk.usage
    return {
        "text": "".join(parts),
        "model": model,
        "usage": u and usage(u.prompt_tokens, u.completion_tokens, u.total_tokens),
        "extra": u and u.model_dump(),
    }


serve({"text": text, "stream": stream})
