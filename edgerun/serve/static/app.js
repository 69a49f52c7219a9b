// edgerun's page: a chat that streams from /v1/chat/completions and a status panel fed by /status.
// Plain JavaScript, no build step, nothing loaded from anywhere but this server.
"use strict";

const KEY_NAME = "edgerun-api-key";
const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null, keyWaiters: null };

// --- the API key: asked once, kept for this tab --------------------------------------------------
function askKey() {
  if (!state.keyWaiters) {
    state.keyWaiters = [];
    $("key").value = "";
    $("key-dialog").showModal();
    $("key").focus();
  }
  return new Promise((resolve) => state.keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", () => {
  const key = $("key").value.trim();
  if (key) sessionStorage.setItem(KEY_NAME, key);
  const waiters = state.keyWaiters || [];
  state.keyWaiters = null;
  waiters.forEach((w) => w());
});

async function api(path, options = {}, retried = false) {
  const headers = Object.assign({}, options.headers || {});
  const key = sessionStorage.getItem(KEY_NAME);
  if (key) headers["Authorization"] = "Bearer " + key;
  const response = await fetch(path, Object.assign({}, options, { headers }));
  if (response.status === 401 && !retried) {
    sessionStorage.removeItem(KEY_NAME);
    await askKey();
    return api(path, options, true);
  }
  return response;
}

async function errorText(response) {
  try {
    const body = await response.json();
    const e = body.error;
    return `${response.status}: ${typeof e === "string" ? e : (e && e.message) || JSON.stringify(body)}`;
  } catch (_) {
    return `HTTP ${response.status}`;
  }
}

// --- status panel -------------------------------------------------------------------------------
function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function setText(id, text) { $(id).firstChild ? ($(id).firstChild.nodeValue = text) : ($(id).textContent = text); }

function showStatus(s) {
  state.model = s.model;
  $("model").textContent = s.model;
  $("drafter").textContent = s.drafter || "none";
  const phase = $("phase");
  phase.textContent = s.status;
  phase.className = "pill " + (s.status === "ready" ? "ready" : s.status === "error" ? "error" : "");
  $("s-profile").textContent = s.profile ? `${s.profile.name}${s.profile.description ? " — " + s.profile.description : ""}` : "–";
  $("s-files").textContent = s.files.length ? s.files.map((f) => `${f.role}: ${f.path.split("/").pop()} (${bytes(f.bytes)})`).join("\n") : "–";
  $("s-ctx").textContent = s.n_ctx ? `${s.n_ctx} tokens` : "–";
  $("s-tps").textContent = s.speed.generations ? `${s.speed.tokens_per_s.toFixed(1)} tok/s` : "no generation yet";
  $("s-accept").textContent = s.speed.acceptance_rate === null ? "– (nothing drafted)" : `${(100 * s.speed.acceptance_rate).toFixed(1)} %`;
  $("s-gamma").textContent = s.speed.gamma === null ? "–" : (s.speed.gamma === 0 ? "0 (speculation off)" : s.speed.gamma.toFixed(2));
  $("s-queue").textContent = `${s.queue.running} running of ${s.queue.slots} slots · ${s.queue.depth} waiting (limit ${s.queue.limit})`;
  const mem = s.memory;
  setText("s-mem", `${bytes(mem.rss_bytes)} / ${mem.budget_bytes ? bytes(mem.budget_bytes) : "?"} (RAM ${bytes(mem.available_bytes)} free of ${bytes(mem.total_bytes)})`);
  const share = mem.budget_bytes ? Math.min(1, mem.rss_bytes / mem.budget_bytes) : 0;
  $("s-mem-bar").style.width = `${(100 * share).toFixed(1)}%`;
  $("s-mem-bar").className = share > 0.9 ? "high" : "";
  $("s-temp").textContent = s.thermal.length ? s.thermal.map((z) => `${z.type || z.zone}: ${z.celsius.toFixed(1)} °C`).join("\n") : "not reported (no thermal zones)";
  $("s-throttle").textContent = s.throttled === null ? "not a Raspberry Pi" :
    (s.throttled.flags.length ? `${s.throttled.raw}: ${s.throttled.flags.join(", ")}` : `${s.throttled.raw}: none`);
  $("s-count").textContent = `${s.speed.generations} / ${s.speed.tokens_total}`;
}

async function refreshStatus() {
  try {
    const r = await api("/status", { cache: "no-store" });
    if (!r.ok) throw new Error(await errorText(r));
    showStatus(await r.json());
    $("status-error").hidden = true;
  } catch (e) {
    $("status-error").textContent = "status: " + e.message;
    $("status-error").hidden = false;
  }
}

// --- chat ---------------------------------------------------------------------------------------
function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function chatError(text) {
  $("chat-error").textContent = text;
  $("chat-error").hidden = !text;
}

async function send(text) {
  chatError("");
  if (!state.model) await refreshStatus();
  state.history.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  out.dataset.state = "streaming";
  const body = { model: state.model, messages: state.history, stream: true,
                 max_tokens: parseInt($("max-tokens").value, 10) || 256 };
  if ($("structured").checked) {
    let schema;
    try { schema = JSON.parse($("schema").value); } catch (e) {
      out.remove(); state.history.pop(); chatError("the schema is not valid JSON: " + e.message); return;
    }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema } };
    out.classList.add("json");
  }
  const controller = new AbortController();
  state.controller = controller;
  busy(true);
  let answer = "", stats = null;
  try {
    const r = await api("/v1/chat/completions", { method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || String(chunk.error));
          const choice = chunk.choices && chunk.choices[0];
          if (choice && choice.delta && choice.delta.content) {
            answer += choice.delta.content;
            out.textContent = answer;
            $("messages").scrollTop = $("messages").scrollHeight;
          }
          if (chunk.edgerun) stats = chunk.edgerun;
        }
      }
    }
    out.dataset.state = "done";
  } catch (e) {
    if (e.name === "AbortError") {
      out.dataset.state = "stopped";
    } else {
      out.dataset.state = "error";
      chatError(e.message);
    }
  } finally {
    state.controller = null;
    busy(false);
  }
  out.textContent = answer;
  const meta = document.createElement("span");
  meta.className = "meta";
  if (out.dataset.state === "stopped") meta.textContent = "stopped";
  else if (stats) meta.textContent = `${stats.finish} · ${stats.tokens_per_s.toFixed(1)} tok/s` +
    (stats.n_drafted ? ` · ${(100 * stats.acceptance_rate).toFixed(0)} % accepted, γ ${stats.gamma_mean.toFixed(1)}` : "");
  if (meta.textContent) out.appendChild(meta);
  if (answer) state.history.push({ role: "assistant", content: answer });
  else state.history.pop();
  refreshStatus();
}

$("ask").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; chatError(""); });
$("structured").addEventListener("change", () => { $("schema").hidden = !$("structured").checked; });

refreshStatus();
setInterval(refreshStatus, 2000);
