// The OpenAI Node SDK, unchanged, against a running gateway (tests/clients/test_openai_node.py runs it):
// one whole answer, one stream, one bad key. Prints what it got as one JSON line.
import OpenAI from "openai";

const [baseURL, apiKey, model, session] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, defaultHeaders: { "x-session-affinity": session } });
const messages = [{ role: "user", content: "Name a colour." }];

const reply = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0 });

const stream = await client.chat.completions.create({
  model, messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let text = "";
let finish = null;
let usage = null;
for await (const chunk of stream) {
  if (chunk.choices.length) {
    text += chunk.choices[0].delta.content ?? "";
    finish = chunk.choices[0].finish_reason ?? finish;
  }
  if (chunk.usage) usage = chunk.usage;
}

let badKeyStatus = null;
try {
  await new OpenAI({ baseURL, apiKey: "wrong", maxRetries: 0 }).chat.completions.create({ model, messages });
} catch (error) {
  badKeyStatus = error.status ?? String(error);
}

console.log(JSON.stringify({
  whole: { text: reply.choices[0].message.content, finish: reply.choices[0].finish_reason, usage: reply.usage },
  stream: { text, finish, usage },
  badKeyStatus,
}));
