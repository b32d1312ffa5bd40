// softsearch web page: upload / drop / pick an image, show top-k with similarity and probability bars.
"use strict";

const $ = (id) => document.getElementById(id);
let maxK = 100;
let lastQuery = null;   // {kind: "item", id, thumb}, {kind: "image", blob, name} or {kind: "text", text}: re-run on filter / page change
let offset = 0;

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

// The class picker lists the index's class values (GET /v1/index `categories`); hidden when it has none.
async function loadFields() {
  const r = await fetch("/v1/index");
  if (!r.ok) return;
  const body = await r.json();
  const classes = (body.categories || {})["class"] || [];
  const select = $("filter-class");
  select.length = 1;
  for (const c of classes) select.add(new Option(c, c));
  select.parentElement.hidden = classes.length === 0;
  $("filter-prefix").parentElement.hidden = !("path" in (body.fields || {}));
}

// The filter, cut-off and page every search route takes.
function searchOptions() {
  const parts = [];
  if ($("filter-class").value) parts.push({ "class": $("filter-class").value });
  if ($("filter-prefix").value) parts.push({ path: { prefix: $("filter-prefix").value } });
  const opts = { k: chosenK(), offset: offset };
  if (parts.length) opts.filter = parts.length === 1 ? parts[0] : { and: parts };
  const t = $("temperature").value;
  if (t) opts.temperature = parseFloat(t);
  const minP = $("min-probability").value;
  if (minP) opts.min_probability = parseFloat(minP);
  return opts;
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
    `version ${body.version} · ${body.count} items · tau ${body.temperature.toPrecision(3)}` +
    (body.matched === null || body.matched === undefined ? "" : ` · ${body.matched} match the filter`);
  $("version").textContent = "index " + body.version;
  // Bars are absolute (probability: width = p): a near-uniform search shows near-empty bars, as it should.
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
    id.textContent = `${body.offset + rank + 1}. ${hit.id}`;
    const similar = document.createElement("button");
    similar.type = "button";
    similar.className = "similar";
    similar.textContent = "similar to this";
    similar.addEventListener("click", () => searchItem(hit.id, img.src));
    card.dataset.similarity = String(hit.similarity);
    card.dataset.probability = String(hit.probability);
    // both bars on one 0..1 scale (legend #bar-legend): the cosine as is, clipped at 0; the probability as is
    const simBar = bar("sim", Math.max(hit.similarity, 0));
    simBar.title = `cosine similarity ${hit.similarity.toFixed(4)} (bar: 0 to 1)`;
    const probBar = bar("prob", hit.probability);
    probBar.title = `probability ${hit.probability.toPrecision(3)} (bar: 0 to 1)`;
    card.append(img, id, sim, simBar, prob, probBar, similar);
    grid.appendChild(card);
  });
  $("bar-legend").hidden = body.results.length === 0;
  const empty = emptyReason(body);
  if (empty) {
    const note = document.createElement("p");
    note.id = "no-results";
    note.className = "empty";
    note.textContent = empty;
    grid.appendChild(note);
  }
  grid.dataset.count = String(body.results.length);
  grid.dataset.version = body.version;
  // pages of k: "next" while the page was full and more hits may pass the cut-off
  const pager = $("pager");
  const more = body.results.length === body.k && body.offset + body.k < maxK &&
               (body.more_may_pass || body.n_passed > body.offset + body.k);
  pager.hidden = body.offset === 0 && !more;
  $("prev-page").disabled = body.offset === 0;
  $("next-page").disabled = !more;
  $("page-info").textContent = body.results.length ? `results ${body.offset + 1}–${body.offset + body.results.length}`
                                                    : "no results";
}

// Why a search returned nothing, in words the user can act on (null when it returned something).
function emptyReason(body) {
  if (body.results.length) return null;
  if (body.matched === 0) return "no item matches the filter; widen it";
  if (body.offset > 0) return `no more results after the first ${body.offset}`;
  const minP = $("min-probability").value;
  if (minP) return `no result above the cut-off p ≥ ${minP}; lower it (or clear it to see every hit)`;
  return "no results";
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
  offset = 0;
  lastQuery = { kind: "item", id: itemId, thumb: thumbnailUrl };
  return rerun();
}

async function search(blob, name) {
  offset = 0;
  lastQuery = { kind: "image", blob: blob, name: name || "query.png" };
  return rerun();
}

// Run the last query again with the current filter, cut-off and page.
function rerun() {
  if (!lastQuery) return;
  const opts = searchOptions();
  if (lastQuery.kind === "item") {
    showPreview(lastQuery.thumb);
    const body = Object.assign({ id: lastQuery.id, include_self: true }, opts);
    return runQuery(() => fetch("/v1/search/item", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }));
  }
  if (lastQuery.kind === "text") {   // POST /v1/search/text: the version's text tower, its text temperature
    $("query-preview").hidden = true;
    const body = Object.assign({ text: lastQuery.text }, opts);
    return runQuery(() => fetch("/v1/search/text", {
      method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }));
  }
  showPreview(URL.createObjectURL(lastQuery.blob));
  const form = new FormData();
  form.append("file", lastQuery.blob, lastQuery.name);
  for (const [key, value] of Object.entries(opts)) {
    form.append(key, key === "filter" ? JSON.stringify(value) : String(value));
  }
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
    const ms = (performance.now() - t0).toFixed(0);
    setStatus(body.results.length ? `${body.results.length} results in ${ms} ms` : `${emptyReason(body)} (${ms} ms)`);
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
  $("text-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("text-query").value.trim();
    if (!text) { setStatus("type some words to search by text", true); return; }
    offset = 0;
    lastQuery = { kind: "text", text: text };
    rerun();
  });
  $("shuffle").addEventListener("click", loadSamples);
  for (const id of ["filter-class", "filter-prefix", "min-probability", "k", "temperature"]) {
    $(id).addEventListener("change", () => { offset = 0; rerun(); });
  }
  $("prev-page").addEventListener("click", () => { offset = Math.max(0, offset - chosenK()); rerun(); });
  $("next-page").addEventListener("click", () => { offset += chosenK(); rerun(); });
}

setupDrop();
loadConfig();
loadFields();
loadSamples();
