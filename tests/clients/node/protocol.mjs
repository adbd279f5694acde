// The loop every Node client script runs (spawned by tests/clients/ as the Python ones are):
// one JSON line on stdin per request, one JSON line on stdout per answer; {"ready": true} first.
// A request's token, model and base_url (the server's URL, without /v1) default to
// METERING_TOKEN, METERING_MODEL and METERING_BASE_URL.
import { createInterface } from "node:readline";

export const BASE_URL = process.env.METERING_BASE_URL.replace(/\/$/, "");

export function usage(prompt, completion, total) {
  if (prompt == null && completion == null && total == null) return null;
  return { prompt_tokens: prompt ?? null, completion_tokens: completion ?? null, total_tokens: total ?? null };
}

export async function serve(ops) {
  process.stdout.write(JSON.stringify({ ready: true }) + "\n");
  const lines = createInterface({ input: process.stdin });
  for await (const line of lines) {
    if (!line.trim()) continue;
    const step = JSON.parse(line);
    step.token ??= process.env.METERING_TOKEN;
    step.model ??= process.env.METERING_MODEL;
    step.base_url ??= BASE_URL;
    step.prompt ??= "Say hello. sim:tokens=12";
    let out;
    try {
      out = { ok: true, ...(await ops[step.op](step)) };
    } catch (error) {
      const cause = error.lastError ?? error;
      // The AI SDK names its errors (AI_...); the openai package's are known by their class.
      const name = (e) => (e.name && e.name !== "Error" ? e.name : e.constructor?.name);
      out = {
        ok: false,
        error: name(error),
        cause: name(cause),
        status: error.status ?? error.statusCode ?? cause.status ?? cause.statusCode ?? null,
        attempts: error.errors?.length ?? null,
        message: String(error.message).slice(0, 2000),
      };
    }
    process.stdout.write(JSON.stringify(out) + "\n");
  }
}
