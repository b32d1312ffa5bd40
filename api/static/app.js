// softsearch web page: upload / drop / pick an image, show top-k with similarity and probability bars.
"use strict";

const $ = (id) => document.getElementById(id);
let maxK = 100;

function setStatus(text, isError) {
  const el = $("status");
  el.textContent = text;
  el.className = isError ? "error" : "muted";
}

async function loadConfig() {
  try {
    const r = await fetch("/v1/config");
    const cfg = await r.json();
    maxK = cfg.max_k;
    $("k").max = String(maxK);
    if (cfg.report_url) { $("report-link").href = cfg.report_url; $("report-link").hidden = false; }
    $("version").textContent = cfg.version ? "index " + cfg.version : "no index loaded";
  } catch (e) { $("version").textContent = "service unreachable"; }
}

async function loadSamples() {
  const box = $("samples");
  box.textContent = "";
  const r = await fetch("/v1/items?n=16");
  if (!r.ok) { box.textContent = "no index loaded"; return; }
  const body = await r.json();
  for (const item of body.items) {
    const img = document.createElement("img");
    img.src = item.thumbnail_url;
    img.alt = item.id;
    img.title = item.id;
    img.dataset.id = item.id;
    img.className = "sample";
    img.addEventListener("click", () => searchItem(item.id, item.thumbnail_url));
    box.appendChild(img);
  }
}

function bar(cls, fraction) {
  const outer = document.createElement("div");
  outer.className = "bar " + cls;
  const inner = document.createElement("span");
  inner.style.width = (Math.max(0, Math.min(1, fraction)) * 100).toFixed(1) + "%";
  outer.appendChild(inner);
  return outer;
}

function render(body) {
  const grid = $("results");
  grid.textContent = "";
  $("result-meta").textContent =
    `version ${body.version} · ${body.count} items · tau ${body.temperature.toPrecision(3)}`;
  $("version").textContent = "index " + body.version;
  // Bars are absolute (width = p): a near-uniform search shows near-empty bars, as it should.
  const peak = body.peakedness;
  const hint = $("peakedness");
  if (hint) {
    hint.textContent = peak ? peak.hint : "";
    hint.className = peak && peak.near_uniform ? "warn" : "note";
  }
  body.results.forEach((hit, rank) => {
    const card = document.createElement("div");
    card.className = "result";
    card.dataset.id = hit.id;
    const img = document.createElement("img");
    img.src = "/v1/items/" + encodeURIComponent(hit.id) + "/thumbnail";
    img.alt = hit.id;
    const id = document.createElement("div");
    id.className = "id";
    id.textContent = `${rank + 1}. ${hit.id}`;
    const sim = document.createElement("div");
    sim.textContent = `similarity ${hit.similarity.toFixed(4)}`;
    const prob = document.createElement("div");
    prob.textContent = `probability ${hit.probability.toPrecision(3)}`;
    const similar = document.createElement("button");
    similar.type = "button";
    similar.className = "similar";
    similar.textContent = "similar to this";
    similar.addEventListener("click", () => searchItem(hit.id, img.src));
    card.append(img, id, sim, bar("sim", (hit.similarity + 1) / 2), prob, bar("prob", hit.probability), similar);
    grid.appendChild(card);
  });
  grid.dataset.count = String(body.results.length);
  grid.dataset.version = body.version;
}

function chosenK() {
  return Math.min(Math.max(parseInt($("k").value || "12", 10), 1), maxK);
}

function showPreview(src) {
  const preview = $("query-preview");
  preview.src = src;
  preview.hidden = false;
}

// A stored item searches with its stored embedding (POST /v1/search/item): no upload, no re-encode.
// The picked item is kept in the results (include_self), so it shows first with its own probability.
function searchItem(itemId, thumbnailUrl) {
  showPreview(thumbnailUrl);
  const body = { id: itemId, k: chosenK(), include_self: true };
  const t = $("temperature").value;
  if (t) body.temperature = parseFloat(t);
  return runQuery(() => fetch("/v1/search/item", {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }));
}

async function search(blob, name) {
  showPreview(URL.createObjectURL(blob));
  const form = new FormData();
  form.append("file", blob, name || "query.png");
  form.append("k", String(chosenK()));
  const t = $("temperature").value;
  if (t) form.append("temperature", t);
  return runQuery(() => fetch("/v1/search", { method: "POST", body: form }));
}

async function runQuery(send) {
  setStatus("searching…");
  const t0 = performance.now();
  try {
    const r = await send();
    const body = await r.json();
    if (!r.ok) { setStatus(`${r.status} ${body.error}: ${body.detail}`, true); return; }
    render(body);
    setStatus(`${body.results.length} results in ${(performance.now() - t0).toFixed(0)} ms`);
  } catch (e) {
    setStatus("request failed: " + e, true);
  }
}

function setupDrop() {
  const drop = $("drop");
  drop.addEventListener("dragover", (e) => { e.preventDefault(); drop.classList.add("over"); });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (e) => {
    e.preventDefault();
    drop.classList.remove("over");
    const f = e.dataTransfer.files[0];
    if (f) search(f, f.name);
  });
  $("file").addEventListener("change", (e) => {
    const f = e.target.files[0];
    if (f) search(f, f.name);
  });
  $("shuffle").addEventListener("click", loadSamples);
}

setupDrop();
loadConfig();
loadSamples();
