"""GET / and GET /status.json: the operator's picture of one server — the verified manifest, the engine's live
figures (the very read GET /metrics renders), the routed-expert cache as a heat map, bytes per token against the
signed contract, and verification failures.

The page is one static document: inline CSS, inline JS and SVG drawn in the browser, no external asset (operators'
machines are often offline). It holds no data: its script polls /status.json once a second and writes every string
with `textContent` (the manifest is signed, but its strings are still text), so nothing from the model or the
engine is ever parsed as HTML. Its Content-Security-Policy forbids any other origin, frame or form target.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

# Served with the page: only its own inline script and style, fetches to this origin only, never framed.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def manifest_card(manifest: Any) -> dict | None:
    """What the page shows of the verified manifest (None: the engine carries none)."""
    if manifest is None:
        return None
    head = manifest.head
    return {"model_id": head.model_id, "version": head.version, "signers": [k.keyid for k in manifest.signers],
            "merkle_root": head.merkle_root.hex(), "created": head.created, "expires": head.expires,
            "expires_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(head.expires)),
            "entries": head.entry_count, "contract": dict(head.contract) if head.contract else None}


def status_document(figures: Mapping[str, Any], card: dict | None, cache: dict | None, now: float) -> dict:
    """/status.json: `figures` is one read of what /metrics exports (numbers only here: per-node maps are for the
    cluster's labelled series), plus what the page derives from them. `now`: a monotonic clock, for rates."""
    numbers = {k: v for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    contract = (card or {}).get("contract") or {}
    return {"time": now, "manifest": card, "figures": numbers,
            "bytes_per_token": {"expert_bytes_per_generated_token": per_token(numbers),
                                "contract_cold": contract.get("expert_bytes_per_token_cold")},
            "expert_cache": cache}


def per_token(figures: Mapping[str, float]) -> float | None:
    """Routed-expert bytes read per generated token since start (None before the first token): the figure the
    signed contract's `expert_bytes_per_token_cold` bounds for one sequence with a cold cache."""
    tokens = figures.get("generation_tokens_total", 0)
    return figures.get("expert_bytes_read_total", 0) / tokens if tokens else None


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>shardtool serve</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .6em}h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse}td,th{padding:2px 10px 2px 0;text-align:left;vertical-align:top}
th{font-weight:600;color:#555}.mono{font-family:ui-monospace,monospace;word-break:break-all}
.figs{display:flex;flex-wrap:wrap;gap:10px}.fig{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:8px 12px;min-width:9em}.fig b{display:block;font-size:1.5em}.bad b{color:#b00}
#state{color:#777}#auth{display:none;margin:1em 0}svg text{font:11px system-ui,sans-serif;fill:#333}
</style></head><body>
<h1>shardtool serve <span id="state">connecting&hellip;</span></h1>
<form id="auth">This server needs its API key: <input id="key" type="password" autocomplete="off">
<button>use</button> (kept in this tab only)</form>
<h2>Verified manifest</h2>
<table><tbody>
<tr><th>model ID</th><td id="m-model_id" class="mono"></td></tr>
<tr><th>version</th><td id="m-version"></td></tr>
<tr><th>signer key IDs</th><td id="m-signers" class="mono"></td></tr>
<tr><th>Merkle root</th><td id="m-merkle_root" class="mono"></td></tr>
<tr><th>expires</th><td id="m-expires_utc"></td></tr>
<tr><th>entries</th><td id="m-entries"></td></tr>
</tbody></table>
<h2>Now</h2>
<div class="figs">
<div class="fig">tokens/s<b id="tps">-</b></div>
<div class="fig">queued<b class="f" data-k="queue_depth">-</b></div>
<div class="fig">running<b class="f" data-k="running">-</b></div>
<div class="fig">KV in use (MiB)<b class="f" data-k="kv_cache_bytes_in_use" data-mib="1">-</b></div>
<div class="fig">KV capacity (MiB)<b class="f" data-k="kv_cache_bytes_capacity" data-mib="1">-</b></div>
<div class="fig">tokens generated<b class="f" data-k="generation_tokens_total">-</b></div>
<div class="fig" id="vf">verification failures<b class="f" data-k="verification_failures_total">-</b></div>
</div>
<svg id="spark" width="420" height="60" role="img" aria-label="tokens per second, last two minutes"></svg>
<h2>Expert bytes per generated token, against the signed contract (cold cache)</h2>
<svg id="bpt" width="520" height="56" role="img" aria-label="bytes per token"></svg>
<h2>Routed-expert cache: one row per MoE layer, one cell per expert (grey: not cached; blue: cached, darker: more hits)</h2>
<svg id="heat" width="10" height="10" role="img" aria-label="expert cache heat map"></svg>
<script>
"use strict";
const NS = "http://www.w3.org/2000/svg";
let last = null, history = [];
function el(name, attrs, text) {
  const e = document.createElementNS(NS, name);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function mib(v) { return (v / 1048576).toFixed(1); }
function show(doc) {
  const m = doc.manifest || {};
  for (const k of ["model_id", "version", "merkle_root", "expires_utc", "entries"])
    document.getElementById("m-" + k).textContent = m[k] === undefined ? "-" : String(m[k]);
  document.getElementById("m-signers").textContent = (m.signers || []).join(", ") || "-";
  for (const node of document.querySelectorAll(".f")) {
    const v = doc.figures[node.dataset.k];
    node.dataset.v = v === undefined ? "" : String(v);
    node.textContent = v === undefined ? "-" : node.dataset.mib ? mib(v) : String(v);
  }
  document.getElementById("vf").className = "fig" + (doc.figures.verification_failures_total ? " bad" : "");
  const tokens = doc.figures.generation_tokens_total || 0;
  if (last !== null && doc.time > last.time) {
    const rate = (tokens - last.tokens) / (doc.time - last.time);
    document.getElementById("tps").textContent = rate.toFixed(1);
    history.push(rate); if (history.length > 120) history.shift();
  }
  last = {time: doc.time, tokens: tokens};
  spark(); bytes(doc.bytes_per_token); heat(doc.expert_cache);
}
function spark() {
  const svg = document.getElementById("spark"); clear(svg);
  const top = Math.max(1, ...history), w = 420, h = 60;
  const pts = history.map((r, i) => (i * w / 119).toFixed(1) + "," + (h - 4 - r / top * (h - 16)).toFixed(1));
  svg.appendChild(el("polyline", {points: pts.join(" "), fill: "none", stroke: "#36c", "stroke-width": 1.5}));
  svg.appendChild(el("text", {x: 2, y: 10}, "tokens/s, peak " + top.toFixed(1)));
}
function bytes(b) {
  const svg = document.getElementById("bpt"); clear(svg);
  const rows = [["measured", b.expert_bytes_per_generated_token, "#36c"], ["contract", b.contract_cold, "#999"]];
  const top = Math.max(1, ...rows.map(r => r[1] || 0));
  rows.forEach((r, i) => {
    const y = 4 + i * 26, v = r[1];
    svg.appendChild(el("text", {x: 0, y: y + 14}, r[0]));
    if (v !== null && v !== undefined)
      svg.appendChild(el("rect", {x: 70, y: y, width: Math.max(1, v / top * 300), height: 18, fill: r[2]}));
    svg.appendChild(el("text", {x: 380, y: y + 14, class: "bv", "data-v": v === null ? "" : String(v)},
                       v === null || v === undefined ? "no tokens yet" : mib(v) + " MiB"));
  });
}
function heat(c) {
  const svg = document.getElementById("heat"); clear(svg);
  const layers = (c && c.layers) || [];
  if (!layers.length) { svg.setAttribute("width", 300); svg.setAttribute("height", 20);
    svg.appendChild(el("text", {x: 0, y: 14}, "no routed experts")); return; }
  const most = Math.max(...layers.map(l => l.experts)), cell = Math.max(3, Math.min(14, Math.floor(900 / most)));
  const top = Math.max(1, ...layers.flatMap(l => l.hits));
  svg.setAttribute("width", 40 + most * cell); svg.setAttribute("height", layers.length * cell + 4);
  layers.forEach((l, row) => {
    const y = row * cell, cached = new Set(l.cached);
    svg.appendChild(el("text", {x: 0, y: y + cell - 2}, "L" + l.layer));
    for (let x = 0; x < l.experts; x++) {
      const h = l.hits[x], on = cached.has(x);
      const light = on ? 85 - 55 * Math.log1p(h) / Math.log1p(top) : 90;
      const r = el("rect", {x: 40 + x * cell, y: y, width: cell - 1, height: cell - 1, class: on ? "hc" : "hn",
                            fill: on ? "hsl(215,70%," + light.toFixed(0) + "%)" : "#e4e4e4"});
      r.appendChild(el("title", {}, "layer " + l.layer + " expert " + x + (on ? ", cached" : "") + ", " + h + " hits"));
      svg.appendChild(r);
    }
  });
}
async function poll() {
  const key = sessionStorage.getItem("shardtool-key");
  try {
    const r = await fetch("status.json", {headers: key ? {Authorization: "Bearer " + key} : {}, cache: "no-store"});
    if (r.status === 401) { document.getElementById("auth").style.display = "block";
      document.getElementById("state").textContent = "needs the API key"; return; }
    const doc = await r.json();
    if (!r.ok) { document.getElementById("state").textContent = (doc.error && doc.error.message) || r.status; return; }
    document.getElementById("auth").style.display = "none";
    show(doc);
    document.getElementById("state").textContent = "live, updated " + new Date().toLocaleTimeString();
  } catch (e) { document.getElementById("state").textContent = "unreachable"; }
}
document.getElementById("auth").addEventListener("submit", ev => {
  ev.preventDefault(); sessionStorage.setItem("shardtool-key", document.getElementById("key").value); poll();
});
poll(); setInterval(poll, 1000);
</script></body></html>
""".encode("utf-8")
