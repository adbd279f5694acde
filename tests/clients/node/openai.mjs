// The `openai` Node SDK: stream usage with stream_options: { include_usage: true }.
import OpenAI from "openai";
import { serve, usage } from "./protocol.mjs";

const client = (step) => new OpenAI({ baseURL: `${step.base_url}/v1`, apiKey: step.token });
const messages = (step) => [{ role: "user", content: step.prompt }];

const ops = {
  async text(step) {
    const answer = await client(step).chat.completions.create({ model: step.model, messages: messages(step) });
    const u = answer.usage;
    return {
      text: answer.choices[0].message.content,
      model: answer.model,
      usage: u ? usage(u.prompt_tokens, u.completion_tokens, u.total_tokens) : null,
      extra: u ?? null,
    };
  },
  async stream(step) {
    const chunks = await client(step).chat.completions.create({
      model: step.model,
      messages: messages(step),
      stream: true,
      ...(step.no_usage ? {} : { stream_options: { include_usage: true } }),
    });
    let text = "", model = null, u = null;
    for await (const chunk of chunks) {
      model = chunk.model || model;
      text += chunk.choices?.[0]?.delta?.content ?? "";
      if (chunk.usage) u = chunk.usage;
    }
    return {
      text,
      model,
      usage: u ? usage(u.prompt_tokens, u.completion_tokens, u.total_tokens) : null,
      extra: u,
    };
  },
};
ops.stream_no_usage = (step) => ops.stream({ ...step, no_usage: true });
await serve(ops);
