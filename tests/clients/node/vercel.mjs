// The Vercel AI SDK (`ai` + `@ai-sdk/openai`), its chat-completions model (openai.chat(...)):
// it asks for usage on every stream.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText } from "ai";
import { serve, usage } from "./protocol.mjs";

// The chat-completions model; with step.responses, the Responses API's (openai(model) alone).
const model = (step) => {
  const provider = createOpenAI({ baseURL: `${step.base_url}/v1`, apiKey: step.token });
  return step.responses ? provider.responses(step.model) : provider.chat(step.model);
};
const counts = (u) => usage(u?.inputTokens, u?.outputTokens, u?.totalTokens);

const ops = {
  async text(step) {
    const result = await generateText({ model: model(step), prompt: step.prompt });
    return { text: result.text, model: result.response.modelId, usage: counts(result.usage) };
  },
  async stream(step) {
    let failure = null;
    const result = streamText({
      model: model(step),
      prompt: step.prompt,
      onError: ({ error }) => { failure = error; },
    });
    let text = "";
    for await (const part of result.textStream) text += part;
    if (failure) throw failure;
    const response = await result.response;
    const u = await result.usage;
    return { text, model: response.modelId, usage: counts(u), extra: { usage: u, metadata: await result.providerMetadata } };
  },
};
ops.responses_text = (step) => ops.text({ ...step, responses: true });
ops.responses_stream = (step) => ops.stream({ ...step, responses: true });
await serve(ops);
