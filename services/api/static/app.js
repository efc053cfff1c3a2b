// Chimera playground: plain browser JavaScript, no build step, no external resources.
// Talks to the HTTP/WebSocket contract of /work/shared/api.md: /v1/models, /v1/chat/completions (SSE),
// /v1/videos (multipart create, polling, content, delete) and /v1/audio/speech/stream (websocket pcm16 deltas).
"use strict";

const KEY_STORE = "chimera.apiKey";
const SAMPLE_RATE = 24000; // pcm16 mono deltas of the speech websocket
const VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]; // documented in README "Speech"
const $ = (id) => document.getElementById(id);

// ---------- API key and errors ----------

/** The API key of this tab's session ("" when none). */
function apiKey() {
  return sessionStorage.getItem(KEY_STORE) || "";
}

/** Request headers with the Bearer key when one is set. */
function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

/** An Error carrying the API's OpenAI-shaped error (status, code, param, message). */
class APIError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(e.message || `HTTP ${status}`);
    this.status = status;
    this.code = e.code || null;
    this.param = e.param || null;
  }
}

/** The readable text of an error: "401 invalid_api_key: <the API's message>". */
function describe(err) {
  if (err instanceof APIError) {
    return `${err.status}${err.code ? " " + err.code : ""}: ${err.message}`;
  }
  if (err && err.name === "AbortError") return "stopped";
  return `request failed: ${err && err.message ? err.message : err}`;
}

function showError(id, err) {
  const el = $(id);
  if (err == null) {
    el.hidden = true;
    el.textContent = "";
  } else {
    el.hidden = false;
    el.textContent = typeof err === "string" ? err : describe(err);
  }
}

/** fetch() a /v1 path with the key; raises APIError for a non-2xx answer (its JSON error body parsed). */
async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
  if (!resp.ok) {
    let body = null;
    try {
      body = await resp.json();
    } catch (_) {
      body = { error: { message: `HTTP ${resp.status} ${resp.statusText}` } };
    }
    throw new APIError(resp.status, body);
  }
  return resp;
}

async function loadModels() {
  try {
    const data = await (await api("/v1/models")).json();
    $("models").textContent = "Models: " + data.data.map((m) => m.id).join(", ");
    showError("global-error", null);
  } catch (err) {
    $("models").textContent = "";
    showError("global-error", err);
  }
}

function setupKey() {
  $("api-key").value = apiKey();
  $("key-status").textContent = apiKey() ? "key set for this tab" : "no key";
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORE, key);
    else sessionStorage.removeItem(KEY_STORE);
    $("key-status").textContent = key ? "key set for this tab" : "no key";
    loadModels();
    refreshJobs();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    $("api-key").value = "";
    $("key-status").textContent = "no key";
    loadModels();
  });
}

// ---------- tabs (arrow keys move between them, as the ARIA tabs pattern does) ----------

function setupTabs() {
  const tabs = [...document.querySelectorAll('[role="tab"]')];
  const select = (tab) => {
    for (const t of tabs) {
      const on = t === tab;
      t.setAttribute("aria-selected", String(on));
      t.tabIndex = on ? 0 : -1;
      $(t.getAttribute("aria-controls")).hidden = !on;
    }
  };
  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => select(tab));
    tab.addEventListener("keydown", (ev) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[ev.key];
      if (step) {
        const next = tabs[(i + step + tabs.length) % tabs.length];
        select(next);
        next.focus();
      }
    });
  });
}

// ---------- chat ----------

const chat = { messages: [], images: [], abort: null };

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

async function attach(files) {
  for (const f of files) {
    if (!f.type.startsWith("image/")) {
      showError("chat-error", `${f.name || "that file"} is not an image`);
      continue;
    }
    chat.images.push({ name: f.name || "pasted image", url: await readAsDataURL(f) });
  }
  renderAttachments();
}

function renderAttachments() {
  const box = $("attachments");
  box.replaceChildren();
  chat.images.forEach((img, i) => {
    const fig = document.createElement("figure");
    const pic = document.createElement("img");
    pic.src = img.url;
    pic.alt = img.name;
    const rm = document.createElement("button");
    rm.type = "button";
    rm.textContent = "Remove";
    rm.setAttribute("aria-label", `Remove ${img.name}`);
    rm.addEventListener("click", () => {
      chat.images.splice(i, 1);
      renderAttachments();
    });
    fig.append(pic, rm);
    box.append(fig);
  });
}

function addTurn(role, text, images = []) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  const who = document.createElement("strong");
  who.textContent = role === "user" ? "You" : "Chimera";
  const body = document.createElement("div");
  body.className = "content";
  body.textContent = text;
  div.append(who);
  for (const img of images) {
    const pic = document.createElement("img");
    pic.src = img.url;
    pic.alt = img.name;
    pic.className = "thumb";
    div.append(pic);
  }
  div.append(body);
  $("chat-log").append(div);
  div.scrollIntoView({ block: "end" });
  return { div, body };
}

/** Yields the parsed JSON of each SSE ``data:`` event of a fetch body until ``[DONE]``. */
async function* sseEvents(resp) {
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value.replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function sendChat(ev) {
  ev.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text && !chat.images.length) {
    showError("chat-error", "type a message or attach an image first");
    return;
  }
  showError("chat-error", null);
  const parts = chat.images.map((img) => ({ type: "image_url", image_url: { url: img.url } }));
  if (text) parts.push({ type: "text", text });
  const userMsg = { role: "user", content: parts.length === 1 && text ? text : parts };
  addTurn("user", text, chat.images);
  const body = {
    messages: [...chat.messages, userMsg],
    stream: true,
    max_tokens: Number($("chat-max-tokens").value) || 64,
    temperature: Number($("chat-temperature").value),
  };
  if ($("chat-json").checked) body.response_format = { type: "json_object" };
  const answer = addTurn("assistant", "");
  answer.div.id = "chat-answer-current";
  document.querySelectorAll(".turn.assistant").forEach((d) => d !== answer.div && d.removeAttribute("id"));
  let chunks = 0;
  answer.div.dataset.chunks = "0";
  answer.div.dataset.done = "false";
  chat.abort = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  $("chat-status").textContent = "answering...";
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: chat.abort.signal,
    });
    for await (const event of sseEvents(resp)) {
      if (event.error) throw new APIError(event.error.status || 500, event);
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (delta && delta.content) {
        answer.body.textContent += delta.content;
        chunks += 1;
        answer.div.dataset.chunks = String(chunks);
      }
    }
    chat.messages.push(userMsg, { role: "assistant", content: answer.body.textContent });
    chat.images = [];
    renderAttachments();
    $("chat-input").value = "";
    $("chat-status").textContent = `done (${chunks} chunks)`;
  } catch (err) {
    if (!answer.body.textContent) answer.div.remove();
    showError("chat-error", err);
    $("chat-status").textContent = "";
  } finally {
    answer.div.dataset.done = "true";
    chat.abort = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

function setupChat() {
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) $("chat-form").requestSubmit();
  });
  $("chat-stop").addEventListener("click", () => chat.abort && chat.abort.abort());
  $("chat-clear").addEventListener("click", () => {
    chat.messages = [];
    chat.images = [];
    renderAttachments();
    $("chat-log").replaceChildren();
    showError("chat-error", null);
  });
  $("chat-files").addEventListener("change", (ev) => {
    attach([...ev.target.files]);
    ev.target.value = "";
  });
  const zone = $("dropzone");
  zone.addEventListener("dragover", (ev) => {
    ev.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (ev) => {
    ev.preventDefault();
    zone.classList.remove("over");
    attach([...ev.dataTransfer.files]);
  });
  $("chat-input").addEventListener("paste", (ev) => {
    const files = [...(ev.clipboardData ? ev.clipboardData.files : [])];
    if (files.length) {
      ev.preventDefault();
      attach(files);
    }
  });
}

// ---------- video ----------

const video = { current: null, timer: null, urls: {} };

/** The multipart form of the video form: only the fields filled in (the API applies its defaults). */
function videoForm() {
  const form = new FormData();
  form.append("prompt", $("video-prompt").value);
  const fields = { negative_prompt: "video-negative", seconds: "video-seconds", size: "video-size", fps: "video-fps",
    num_frames: "video-frames", num_inference_steps: "video-steps", guidance_scale: "video-guidance",
    sparsity: "video-sparsity", seed: "video-seed" };
  for (const [name, id] of Object.entries(fields)) {
    const v = $(id).value.trim();
    if (v !== "") form.append(name, v);
  }
  form.append("drift_correction", $("video-drift").checked ? "true" : "false");
  const file = $("video-image").files[0];
  if (file) form.append("input_reference", file, file.name);
  return form;
}

async function submitVideo(ev) {
  ev.preventDefault();
  showError("video-error", null);
  $("video-submit").disabled = true;
  try {
    const job = await (await api("/v1/videos", { method: "POST", body: videoForm() })).json();
    $("video-status").textContent = `queued ${job.id}`;
    $("video-player").hidden = true;
    $("video-download").hidden = true;
    track(job);
  } catch (err) {
    showError("video-error", err);
  } finally {
    $("video-submit").disabled = false;
  }
}

function showProgress(job) {
  const bar = $("video-progress");
  bar.value = job.progress || 0;
  bar.dataset.status = job.status;
  const phase = job.phase ? `, ${job.phase}` : "";
  const clips = job.clips_total ? `, clip ${Math.min(job.clips_done + 1, job.clips_total)}/${job.clips_total}` : "";
  $("video-progress-text").textContent = `${job.id}: ${job.status}${phase}${job.status === "completed" ? "" : clips} ${job.progress || 0}%`;
}

/** Poll one job until it finishes (every 500 ms, the API's openai-poll-after-ms), then play it. */
function track(job) {
  clearTimeout(video.timer);
  video.current = job.id;
  showProgress(job);
  const poll = async () => {
    if (video.current !== job.id) return;
    try {
      const j = await (await api(`/v1/videos/${job.id}`)).json();
      if (video.current !== job.id) return; // another job was chosen, or this one deleted, meanwhile
      showProgress(j);
      if (j.status === "completed") {
        await play(j.id);
        refreshJobs();
      } else if (j.status === "failed" || j.status === "cancelled") {
        showError("video-error", j.error ? `${j.status} ${j.error.code}: ${j.error.message}` : j.status);
        refreshJobs();
      } else {
        video.timer = setTimeout(poll, 500);
      }
    } catch (err) {
      if (video.current === job.id) showError("video-error", err); // else: deleted meanwhile
    }
  };
  video.timer = setTimeout(poll, 300);
  refreshJobs();
}

/** An object URL of a completed job's content (fetched with the key: a <video src> cannot send headers). */
async function contentURL(id, variant) {
  const k = `${id}:${variant}`;
  if (!video.urls[k]) {
    const blob = await (await api(`/v1/videos/${id}/content?variant=${variant}`)).blob();
    video.urls[k] = URL.createObjectURL(blob);
  }
  return video.urls[k];
}

async function play(id) {
  const url = await contentURL(id, "video");
  const player = $("video-player");
  player.src = url;
  player.dataset.videoId = id;
  player.hidden = false;
  const dl = $("video-download");
  dl.href = url;
  dl.download = `${id}.mp4`;
  dl.hidden = false;
}

async function refreshJobs() {
  const list = $("video-jobs");
  let page;
  try {
    page = await (await api("/v1/videos?limit=10")).json();
  } catch (err) {
    if (!(err instanceof APIError && err.status === 404)) showError("video-error", err);
    return;
  }
  list.replaceChildren();
  for (const j of page.data) {
    const li = document.createElement("li");
    li.dataset.videoId = j.id;
    const thumb = document.createElement("img");
    thumb.alt = `thumbnail of ${j.id}`;
    thumb.className = "thumb";
    if (j.status === "completed") contentURL(j.id, "thumbnail").then((u) => (thumb.src = u)).catch(() => {});
    const info = document.createElement("span");
    info.textContent = `${j.status} ${j.progress}% · ${j.seconds} s · ${j.size}`;
    const actions = document.createElement("span");
    actions.className = "row";
    const button = (label, fn) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = label;
      b.setAttribute("aria-label", `${label} ${j.id}`);
      b.addEventListener("click", fn);
      actions.append(b);
    };
    if (j.status === "completed") button("Play", () => { track(j); });
    if (j.status === "queued" || j.status === "in_progress") button("Cancel", () => removeJob(j.id));
    else button("Delete", () => removeJob(j.id));
    li.append(thumb, info, actions);
    list.append(li);
  }
  if (!page.data.length) {
    const li = document.createElement("li");
    li.className = "muted";
    li.textContent = "no jobs yet";
    list.append(li);
  }
}

async function removeJob(id) {
  const current = video.current === id;
  if (current) {
    clearTimeout(video.timer);
    video.current = null; // a poll still in flight ignores its answer
  }
  try {
    await api(`/v1/videos/${id}`, { method: "DELETE" });
    if (current) $("video-progress-text").textContent = `${id}: deleted`;
  } catch (err) {
    showError("video-error", err);
  }
  refreshJobs();
}

function setupVideo() {
  $("video-form").addEventListener("submit", submitVideo);
  $("video-refresh").addEventListener("click", refreshJobs);
}

// ---------- speech ----------

const speech = { ws: null, ctx: null, playAt: 0, pcm: [], samples: 0, chunks: 0 };

function b64ToInt16(b64) {
  const bin = atob(b64);
  const bytes = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);
}

/** A WAV file (pcm16, 24 kHz mono) of the Int16Array pieces received. */
function wavBlob(pieces) {
  const n = pieces.reduce((s, p) => s + p.length, 0);
  const buf = new ArrayBuffer(44 + 2 * n);
  const v = new DataView(buf);
  const str = (o, s) => [...s].forEach((c, i) => v.setUint8(o + i, c.charCodeAt(0)));
  str(0, "RIFF"); v.setUint32(4, 36 + 2 * n, true); str(8, "WAVE"); str(12, "fmt ");
  v.setUint32(16, 16, true); v.setUint16(20, 1, true); v.setUint16(22, 1, true);
  v.setUint32(24, SAMPLE_RATE, true); v.setUint32(28, SAMPLE_RATE * 2, true);
  v.setUint16(32, 2, true); v.setUint16(34, 16, true); str(36, "data"); v.setUint32(40, 2 * n, true);
  let o = 44;
  for (const p of pieces) {
    new Int16Array(buf, o, p.length).set(p);
    o += 2 * p.length;
  }
  return new Blob([buf], { type: "audio/wav" });
}

function drawWave() {
  const canvas = $("speech-wave");
  const g = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height;
  g.clearRect(0, 0, w, h);
  g.fillStyle = getComputedStyle(canvas).color;
  const all = speech.samples;
  if (!all) return;
  const per = Math.max(1, Math.ceil(all / w));
  let x = 0, i = 0, peak = 0;
  for (const p of speech.pcm) {
    for (let k = 0; k < p.length; k++, i++) {
      peak = Math.max(peak, Math.abs(p[k]) / 32768);
      if ((i + 1) % per === 0) {
        g.fillRect(x++, h / 2 - (peak * h) / 2, 1, Math.max(1, peak * h));
        peak = 0;
      }
    }
  }
}

/** Play one pcm16 delta right after the previous one (Web Audio), and update counters, meter and waveform. */
function onAudio(pcm) {
  speech.pcm.push(pcm);
  speech.samples += pcm.length;
  speech.chunks += 1;
  $("speech-chunks").value = String(speech.chunks);
  $("speech-seconds").value = (speech.samples / SAMPLE_RATE).toFixed(2);
  let sum = 0;
  const f = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) {
    f[i] = pcm[i] / 32768;
    sum += f[i] * f[i];
  }
  $("speech-level").value = Math.min(1, Math.sqrt(sum / Math.max(1, pcm.length)) * 2);
  drawWave();
  if (speech.ctx && pcm.length) {
    const b = speech.ctx.createBuffer(1, pcm.length, SAMPLE_RATE);
    b.copyToChannel(f, 0);
    const src = speech.ctx.createBufferSource();
    src.buffer = b;
    src.connect(speech.ctx.destination);
    speech.playAt = Math.max(speech.playAt, speech.ctx.currentTime + 0.05);
    src.start(speech.playAt);
    speech.playAt += b.duration;
  }
}

function speechDone(status) {
  $("speech-speak").disabled = false;
  $("speech-stop").disabled = true;
  $("speech-status").textContent = status;
  if (speech.samples) {
    const dl = $("speech-download");
    if (dl.href) URL.revokeObjectURL(dl.href);
    dl.href = URL.createObjectURL(wavBlob(speech.pcm));
    dl.hidden = false;
  }
}

function speak(ev) {
  ev.preventDefault();
  showError("speech-error", null);
  const text = $("speech-text").value;
  if (!text.trim()) {
    showError("speech-error", "type some text first");
    return;
  }
  Object.assign(speech, { pcm: [], samples: 0, chunks: 0, playAt: 0 });
  $("speech-chunks").value = "0";
  $("speech-seconds").value = "0.00";
  $("speech-download").hidden = true;
  drawWave();
  try {
    speech.ctx = speech.ctx || new AudioContext();
    speech.ctx.resume();
  } catch (_) {
    speech.ctx = null; // no audio output here: chunks are still counted, drawn and downloadable
  }
  const url = new URL("/v1/audio/speech/stream", location.href);
  url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
  if (apiKey()) url.searchParams.set("api_key", apiKey()); // browsers cannot set headers on a websocket
  const session = { voice: $("speech-voice").value, speed: Number($("speech-speed").value) };
  if ($("speech-seed").value !== "") session.seed = Number($("speech-seed").value);
  const ws = new WebSocket(url);
  speech.ws = ws;
  $("speech-speak").disabled = true;
  $("speech-stop").disabled = false;
  $("speech-status").textContent = "connecting...";
  let finished = false;
  // the text is sent once the session is configured, so a rejected setting (voice, speed, seed) speaks nothing
  let opened = false;
  ws.onopen = () => {
    opened = true;
    ws.send(JSON.stringify({ type: "session.update", session }));
  };
  ws.onmessage = (msg) => {
    const e = JSON.parse(msg.data);
    if (e.type === "session.updated") {
      ws.send(JSON.stringify({ type: "input_text.append", text }));
      ws.send(JSON.stringify({ type: "input_text.commit" }));
      $("speech-status").textContent = "speaking...";
    } else if (e.type === "response.audio.delta") {
      onAudio(b64ToInt16(e.delta));
    } else if (e.type === "error") {
      showError("speech-error", `${e.error.code || e.error.type}: ${e.error.message}`);
      if (!speech.chunks) {
        finished = true;
        speechDone("failed");
        ws.close();
      }
    } else if (e.type === "response.audio.done") {
      finished = true;
      speechDone(e.status === "completed" ? `done: ${e.usage.audio_seconds} s of audio` : e.status);
      ws.close();
    }
  };
  ws.onclose = async (e) => {
    if (speech.ws === ws) speech.ws = null;
    if (finished) return;
    speechDone("closed");
    if (!opened) {
      // a refused handshake (e.g. a wrong API key) tells the page nothing: ask the HTTP API why
      try {
        await api("/v1/models");
        showError("speech-error", `could not open the speech websocket (close code ${e.code})`);
      } catch (err) {
        showError("speech-error", err);
      }
    } else if (e.code !== 1000 && e.code !== 1005) {
      showError("speech-error", `connection closed (${e.code}) ${e.reason}`);
    }
  };
}

function setupSpeech() {
  const sel = $("speech-voice");
  for (const v of VOICES) {
    const o = document.createElement("option");
    o.value = o.textContent = v;
    sel.append(o);
  }
  $("speech-form").addEventListener("submit", speak);
  $("speech-stop").addEventListener("click", () => {
    if (speech.ws && speech.ws.readyState === WebSocket.OPEN) speech.ws.send(JSON.stringify({ type: "response.cancel" }));
  });
}

document.addEventListener("DOMContentLoaded", () => {
  setupKey();
  setupTabs();
  setupChat();
  setupVideo();
  setupSpeech();
  loadModels();
  refreshJobs();
});
