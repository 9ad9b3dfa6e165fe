// pdserve's chat page: streams answers from /v1/chat/completions (SSE read through fetch and a
// ReadableStream), keeps the conversation, and shows per answer its TTFT, its tokens per second
// and the prefill and decode workers that served it (the x-pdserve-* response headers, then the
// stream's closing `: pdserve served-by {...}` comment, which names the final workers of a
// request that migrated). Plain JavaScript, no framework, nothing from another origin: the
// router's Content-Security-Policy allows this origin only, and no inline script. URLs are
// relative to the page, so the page also works behind a proxy that puts a prefix before the router.
"use strict";

const KEY_STORAGE = "pdserve.apiKey";
const SERVED_BY = "pdserve served-by ";
const $ = (id) => document.getElementById(id);

const page = {
  model: null,        // from /v1/models
  history: [],        // the conversation sent with each question: [{role, content}]
  controller: null,   // the AbortController of the answer being streamed
};

// --- the API key: asked for on a 401, kept for this tab only ---------------------------------

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: "Bearer " + key } : {};
}

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-button").hidden = false;
  const error = $("key-error");
  error.textContent = message || "";
  error.hidden = !message;
  $("api-key").focus();
}

// --- talking to the router -------------------------------------------------------------------

// A non-2xx answer as one line: "401 invalid_api_key: missing or invalid API key ...".
async function errorText(response) {
  const text = await response.text();
  try {
    const err = JSON.parse(text).error;
    if (err && err.message) {
      return `${response.status} ${err.code || err.type || "error"}: ${err.message}`;
    }
  } catch (_) {
    // not the OpenAI envelope: show the body as it is
  }
  return `HTTP ${response.status}: ${text.slice(0, 300) || response.statusText}`;
}

function setStatus(text, bad = false) {
  const status = $("status");
  status.textContent = text;
  status.classList.toggle("bad", bad);
}

// Learns the model name; a 401 opens the key form. Returns whether the router answered 200.
async function connect() {
  let response;
  try {
    response = await fetch("v1/models", { headers: authHeaders(), cache: "no-store" });
  } catch (e) {
    setStatus(`cannot reach the router (${e.message})`, true);
    return false;
  }
  if (response.status === 401) {
    const message = await errorText(response);
    setStatus("an API key is required", true);
    askForKey(apiKey() ? `The key was refused: ${message}` : "");
    return false;
  }
  if (!response.ok) {
    setStatus(await errorText(response), true);
    return false;
  }
  const body = await response.json();
  page.model = body.data[0].id;
  $("model").textContent = page.model;
  $("key-form").hidden = true;
  setStatus("ready");
  return true;
}

// The server-sent events of a response body: {data} for each event, {comment} for each comment.
// A consumer that stops early (an error event, [DONE]) cancels the body: the connection closes.
async function* sseEvents(body) {
  const reader = body.getReader();
  try {
    yield* parseEvents(reader);
  } finally {
    reader.cancel().catch(() => {});
  }
}

async function* parseEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
    const lines = buffer.split("\n");
    buffer = done ? "" : lines.pop();
    for (const raw of lines) {
      const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
      if (line === "") {
        if (data.length) yield { data: data.join("\n") };
        data = [];
      } else if (line.startsWith(":")) {
        yield { comment: line.slice(1).trimStart() };
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "data") data.push(value);
      }
    }
    if (done) {
      if (data.length) yield { data: data.join("\n") };
      return;
    }
  }
}

function servedFromHeaders(headers) {
  const first = (name) => {
    const value = headers.get(name);
    return value ? decodeURIComponent(value.split(",")[0]) : null;
  };
  const prefill = first("x-pdserve-prefill-worker");
  if (prefill === null) return null;
  return { mode: first("x-pdserve-mode"), prefill, decode: first("x-pdserve-decode-worker"), migrations: 0 };
}

// --- the conversation on screen --------------------------------------------------------------

class MessageView {
  constructor(role, text) {
    this.el = document.createElement("div");
    this.el.className = `message ${role}`;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    this.content = document.createElement("div");
    this.content.className = "content";
    this.content.textContent = text;
    this.el.append(label, this.content);
    $("messages").append(this.el);
    this.el.scrollIntoView({ block: "end" });
  }

  append(text) {
    this.content.textContent += text;
    this.el.scrollIntoView({ block: "end" });
  }

  fail(message) {
    const error = document.createElement("p");
    error.className = "error";
    error.setAttribute("role", "alert");
    error.textContent = message;
    this.el.append(error);
    this.el.scrollIntoView({ block: "end" });
  }
}

// One answer being streamed: its text, its timings, and who served it.
class Answer extends MessageView {
  constructor() {
    super("assistant", "");
    this.meta = document.createElement("div");
    this.meta.className = "meta";
    this.el.append(this.meta);
    this.started = performance.now();
    this.firstAt = null;
    this.lastAt = null;
    this.pieces = 0;     // content chunks seen: the token count when the stream gave no usage
    this.tokens = null;  // completion_tokens from the usage chunk
    this.finish = null;
    this.served = null;
    this.setState("streaming");
  }

  setState(state) {
    this.el.dataset.state = state;
    this.render();
  }

  text() {
    return this.content.textContent;
  }

  // One parsed chunk of the stream (choice 0 is the one shown).
  onChunk(chunk) {
    if (chunk.id) this.el.dataset.requestId = chunk.id;
    if (chunk.usage) this.tokens = chunk.usage.completion_tokens;
    for (const choice of chunk.choices || []) {
      if (choice.index !== 0) continue;
      const piece = choice.delta && choice.delta.content;
      if (piece) {
        const now = performance.now();
        if (this.firstAt === null) this.firstAt = now;
        this.lastAt = now;
        this.pieces += 1;
        this.append(piece);
      }
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
    this.render();
  }

  setServed(served) {
    if (!served) return;
    this.served = served;
    Object.assign(this.el.dataset, {
      mode: served.mode, prefill: served.prefill, decode: served.decode, migrations: served.migrations,
    });
    this.render();
  }

  render() {
    const parts = [];
    if (this.firstAt !== null) {
      const ttft = this.firstAt - this.started;
      this.el.dataset.ttftMs = ttft.toFixed(0);
      parts.push(["ttft", `TTFT ${ttft.toFixed(0)} ms`]);
    }
    const tokens = this.tokens !== null ? this.tokens : this.pieces;
    if (tokens) {
      this.el.dataset.tokens = tokens;
      const exact = this.tokens !== null;
      parts.push(["tokens", `${exact ? "" : "~"}${tokens} tokens`]);
      // Decode speed: the tokens after the first over the time they took.
      const seconds = (this.lastAt - this.firstAt) / 1000;
      if (tokens > 1 && seconds > 0) {
        const rate = (tokens - 1) / seconds;
        this.el.dataset.tokensPerSecond = rate.toFixed(1);
        parts.push(["rate", `${rate.toFixed(1)} tok/s`]);
      }
    }
    if (this.finish) parts.push(["finish", `finish: ${this.finish}`]);
    if (this.el.dataset.state === "stopped") parts.push(["finish", "stopped"]);
    if (this.served) {
      const s = this.served;
      const route = s.mode === "colocated" ? `${s.prefill} (colocated)` : `${s.prefill} → ${s.decode}`;
      const migrated = s.migrations > 0 ? `, migrated ${s.migrations}×` : "";
      parts.push(["served", `served by ${route}${migrated}`]);
    }
    this.meta.replaceChildren(...parts.map(([cls, text]) => {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      if (cls === "served") span.title = "prefill worker → decode worker";
      return span;
    }));
  }
}

// --- asking ----------------------------------------------------------------------------------

function samplingFields() {
  const fields = {};
  const temperature = parseFloat($("temperature").value);
  const maxTokens = parseInt($("max-tokens").value, 10);
  const topP = parseFloat($("top-p").value);
  if (!Number.isNaN(temperature)) fields.temperature = temperature;
  if (!Number.isNaN(maxTokens)) fields.max_tokens = maxTokens;
  if (!Number.isNaN(topP)) fields.top_p = topP;
  return fields;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

class StreamError extends Error {}

// Streams one answer into `answer`; resolves to "done" or "stopped", throws StreamError otherwise.
async function stream(answer, messages, signal) {
  const body = {
    model: page.model, messages, stream: true, stream_options: { include_usage: true },
    ...samplingFields(),
  };
  let response;
  try {
    response = await fetch("v1/chat/completions", {
      method: "POST",
      headers: { "content-type": "application/json", ...authHeaders() },
      body: JSON.stringify(body),
      signal,
    });
  } catch (e) {
    if (signal.aborted) return "stopped";
    throw new StreamError(`network error: the router could not be reached (${e.message})`);
  }
  if (!response.ok) {
    const message = await errorText(response);
    if (response.status === 401) {
      askForKey(message);
      throw new StreamError(`${message}\nEnter the API key above, then send again.`);
    }
    throw new StreamError(message);
  }
  answer.setServed(servedFromHeaders(response.headers));
  try {
    for await (const event of sseEvents(response.body)) {
      if (event.comment !== undefined) {
        if (event.comment.startsWith(SERVED_BY)) {
          const final = JSON.parse(event.comment.slice(SERVED_BY.length)).choices[0];
          answer.setServed(final);
        }
        continue;
      }
      if (event.data === "[DONE]") return "done";
      const chunk = JSON.parse(event.data);
      if (chunk.error) {
        const err = chunk.error;
        throw new StreamError(`the answer failed: ${err.code || err.type || "error"}: ${err.message}`);
      }
      answer.onChunk(chunk);
    }
  } catch (e) {
    if (signal.aborted) return "stopped";
    if (e instanceof StreamError) throw e;
    throw new StreamError(`the stream broke off: ${e.message}`);
  }
  if (signal.aborted) return "stopped";
  throw new StreamError("the stream ended before its last event ([DONE])");
}

async function ask(text) {
  if (page.model === null && !(await connect())) {
    setStatus($("status").textContent + " — the question was not sent", true);
    if (!$("prompt").value) $("prompt").value = text;
    return;
  }
  const history = page.history;  // a "New chat" meanwhile starts another array
  const question = new MessageView("user", text);
  const turn = { role: "user", content: text };
  history.push(turn);
  const answer = new Answer();
  const controller = new AbortController();
  page.controller = controller;
  setBusy(true);
  try {
    const outcome = await stream(answer, history.slice(), controller.signal);
    answer.setState(outcome);
    if (answer.text()) {
      history.push({ role: "assistant", content: answer.text() });
    } else {  // stopped before a word: the question leaves the conversation
      history.splice(history.indexOf(turn), 1);
      question.el.classList.add("excluded");
    }
  } catch (e) {
    // A failed turn leaves the conversation: the question goes back into the box to retry.
    answer.fail(e.message);
    answer.setState("error");
    history.splice(history.indexOf(turn), 1);
    question.el.classList.add("excluded");
    answer.el.classList.add("excluded");
    if (!$("prompt").value) $("prompt").value = text;
  } finally {
    if (page.controller === controller) page.controller = null;
    setBusy(page.controller !== null);
  }
}

// --- wiring ----------------------------------------------------------------------------------

function init() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || page.controller) return;
    $("prompt").value = "";
    ask(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => {
    if (page.controller) page.controller.abort();
  });
  $("new-chat").addEventListener("click", () => {
    if (page.controller) page.controller.abort();
    page.history = [];
    $("messages").replaceChildren();
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORAGE, key);
    $("api-key").value = "";
    await connect();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    page.model = null;
    askForKey("");
  });
  $("key-button").addEventListener("click", () => askForKey(""));
  connect();
}

init();
